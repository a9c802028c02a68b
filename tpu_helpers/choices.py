"""The values a user may type for the names that pick a device, a precision or a model size, as plain constants.

    from tpu_helpers.choices import DEVICES, PRECISIONS, PRESET_NAMES

They live here, apart from the modules that implement them (the backend, the GPT), so that `tpu_helpers.config`
and the command lines can validate a setting without importing torch; the backend and the model import them from
here, and a test checks that `tpu_helpers.models.gpt.PRESETS` has exactly these names.
"""

DEVICES = ("auto", "tpu", "cuda", "cpu", "xla")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
PRESET_NAMES = ("tiny", "mini", "small", "medium")
