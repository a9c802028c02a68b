"""ENVIRONMENT and TOOLS (agents/loading.py): both forms load, and every bad value is a ConfigError naming the
parameter, the value and what is allowed."""

from __future__ import annotations

import textwrap

import pytest

from tpu_helpers.agents import load_environment, load_tools
from tpu_helpers.core.choices import ConfigError

SOURCE = textwrap.dedent('''
    NOT_CALLABLE = 3

    class Counter:
        def reset(self, **row):
            self.n = 0

        def bump(self, by: int) -> int:
            """Bump the counter.

            Args:
                by: How much.
            """
            self.n += by
            return self.n

    class NoReset:
        pass

    def double(x: int) -> int:
        """Double a number.

        Args:
            x: The number.
        """
        return 2 * x

    def untyped(x):
        """Untyped.

        Args:
            x: The number.
        """

    def undocumented(x: int) -> int:
        return x
''')


@pytest.fixture
def envs(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_both_forms_load(envs):
    assert load_environment("my_envs:Counter").__name__ == "Counter"
    assert load_environment(f"{envs}/my_envs.py:Counter").__name__ == "Counter"
    assert load_environment("my_envs.Counter").__name__ == "Counter"  # the dotted form, as REWARDS always took
    assert [f.__name__ for f in load_tools("my_envs:double, ./my_envs.py:double")] == ["double", "double"]


@pytest.mark.parametrize("parameter, value, message", [
    ("ENVIRONMENT", "my_envs", r"ENVIRONMENT='my_envs' is not of the form 'module:Name' or 'path/to/file.py:Name'"),
    ("ENVIRONMENT", "no_such_module:Env", r"ENVIRONMENT='no_such_module:Env': module 'no_such_module' cannot be "
                                          r"imported \(ModuleNotFoundError"),
    ("ENVIRONMENT", "envs/missing.py:Env", r"ENVIRONMENT='envs/missing.py:Env': there is no file .*missing.py; give"),
    ("ENVIRONMENT", "my_envs:Nope", r"ENVIRONMENT='my_envs:Nope': my_envs has no 'Nope'; it defines \['Counter', "
                                    r"'NoReset', 'double', 'undocumented', 'untyped'\]"),
    ("ENVIRONMENT", "my_envs:NOT_CALLABLE", r"ENVIRONMENT='my_envs:NOT_CALLABLE' is a int, not a callable"),
    ("ENVIRONMENT", "my_envs:NoReset", r"ENVIRONMENT='my_envs:NoReset': the environment NoReset has no reset method"),
    ("TOOLS", "my_envs:double, my_envs:untyped", r"TOOLS='my_envs:double, my_envs:untyped': tool 'untyped' has no "
                                                 r"JSON schema \(TypeHintParsingException"),
    ("TOOLS", "my_envs:undocumented", r"TOOLS='my_envs:undocumented': tool 'undocumented' has no JSON schema "
                                      r"\(DocstringParsingException"),
    ("TOOLS", " , ", r"TOOLS=' , ' names no tools"),
], ids=["no-colon", "no-module", "no-file", "no-attribute", "not-callable", "no-reset", "untyped-tool",
        "undocumented-tool", "empty"])
def test_each_bad_value_is_a_clear_error(envs, parameter, value, message):
    load = load_environment if parameter == "ENVIRONMENT" else load_tools
    with pytest.raises(ConfigError, match=message):
        load(value)


def test_a_file_that_fails_to_import_is_named(envs):
    (envs / "broken.py").write_text("raise RuntimeError('half written')\n")
    with pytest.raises(ConfigError, match=r"ENVIRONMENT='broken.py:Env': importing .*broken.py raised RuntimeError: "
                                          r"half written"):
        load_environment("broken.py:Env")
