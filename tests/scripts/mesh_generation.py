"""Greedy generation with the backend's decode loop on an SPMD mesh (CPU_NUM_DEVICES=8, the caller's): for each
family of the JSON argument's "families", the tokens and log-probabilities of three calls on the model placed for
"sharding" with the prompts' rows split over the chips (as the loader lays out a batch), the CPU's for the same
prompts, whether the decode ran as a device loop, what a third call compiled (the first call makes the kept
cache, the second resets it: each compiles its prefill), and a fourth call's with fewer new tokens in the same cache
(its tokens the first ones of the CPU's); for the first family also 2 sampled answers per prompt with the prompt's
pass shared (`num_return_sequences`), against the CPU's. The calls pass `replay` and `loop` as GRPO's rollouts do.
For tests/models/test_generation_loop.py.

    python tests/scripts/mesh_generation.py '{"sharding": "data", "families": ["llama3"]}'
"""

from __future__ import annotations

import torch

from tests.models.families import FAMILIES, random_model
from tests.support import print_result, script_args
from tpu_helpers.backend import get_backend
from tpu_helpers.models.generation import Sampling, generate_ids, left_pad

VOCAB = 97


def main() -> None:
    args = script_args()
    b = get_backend("xla", spmd=True, compile_cache_dir=None)
    torch.manual_seed(0)
    p = left_pad([torch.randint(3, VOCAB, (n,)).tolist() for n in (12, 7, 3, 10, 5, 9, 11, 4)], 12, 0)
    out = {}
    for family in args["families"]:
        model = random_model(FAMILIES[family].config(VOCAB, pad=0), seed=1)
        want = generate_ids(model, p.ids, p.mask, max_new_tokens=9, eos_token_id=None, pad_token_id=0)
        shared = dict(max_new_tokens=9, eos_token_id=[5, 9], pad_token_id=0, sampling=Sampling(temperature=1.5),
                      num_return_sequences=2)
        want_shared = generate_ids(model, p.ids, p.mask, seed=torch.tensor([3, 1]), **shared)
        model = b.prepare_model(model, args["sharding"])
        loops: list = []

        def make_loop(loops=loops):
            loops.append(b.compile_loop())
            return loops[-1]

        # The rows split over the chips, as the loader lays out GRPO's prompt batches.
        ids, mask = b.shard_rows(p.ids.to(b.device)), b.shard_rows(p.mask.to(b.device))
        compiles = []
        for _ in range(3):
            before = b.metrics()["compilations"]
            got = generate_ids(model, ids, mask, max_new_tokens=9, eos_token_id=None, pad_token_id=0, sync=b.sync,
                               replay=b.compile_step, loop=make_loop)
            host = b.to_cpu({"ids": got.ids, "logprobs": got.logprobs})  # as GRPO reads its rollouts
            got_ids, got_lp = host["ids"], host["logprobs"]
            compiles.append(b.metrics()["compilations"] - before)
        before = b.metrics()["compilations"]
        short = generate_ids(model, ids, mask, max_new_tokens=5, eos_token_id=None, pad_token_id=0, sync=b.sync,
                             replay=b.compile_step, loop=make_loop, cache_len=p.ids.shape[1] + 9)
        short_ids = b.to_cpu({"ids": short.ids, "logprobs": short.logprobs})["ids"]  # the same read: no new gather
        out[family] = {"same_ids": torch.equal(got_ids, want.ids),
                       "logprob_diff": float((got_lp - want.logprobs).abs().max()),
                       "looped": bool(loops and loops[0] is not None and loops[0]._built),
                       "third_call_compiles": compiles[2], "mesh": list(b.mesh_shape),
                       "shorter_same_ids": torch.equal(short_ids[:, :5], want.ids[:, :5]),
                       "shorter_call_compiles": b.metrics()["compilations"] - before}
        if family == args["families"][0]:
            got = generate_ids(model, ids, mask, seed=torch.tensor([3, 1]).to(b.device), sync=b.sync,
                               replay=b.compile_step, loop=make_loop, **shared)
            host = b.to_cpu({"ids": got.ids, "mask": got.mask})
            out[family]["shared_same_ids"] = torch.equal(host["ids"], want_shared.ids) and \
                torch.equal(host["mask"], want_shared.mask)
    print_result(out)


if __name__ == "__main__":
    main()
