"""`python -m noria.frontend.doctor_generation PROBE_JSON OUT`: one short greedy generation for
`noria doctor` (worker/doctor_checks.py), written to OUT as a `GenerationRun`.

A child of its own because the doctor lives beside the worker and may not import `LLM`.
The environment chooses the attention path (NORIA_EMULATED_KERNELS); the probe the rest.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from noria.protocol.doctor import GenerationProbe, GenerationRun, GenerationSample


def run(probe: GenerationProbe) -> GenerationRun:
    from noria.frontend.llm import LLM
    from noria.protocol.sampling import SamplingParams

    params = SamplingParams(max_tokens=probe.max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    with LLM("demo", dtype="float32", seed=0, **probe.engine) as llm:
        outs = llm.generate(probe.prompts, params, use_tqdm=False)
        stats = llm.stats()
    samples = [GenerationSample(token_ids=list(o.outputs[0].token_ids), logprobs=list(o.outputs[0].logprobs or []))
               for o in outs]
    return GenerationRun(samples=samples, stats=stats)


def main(argv: list[str]) -> int:
    probe_json, out = argv
    result = run(msgspec.json.decode(probe_json, type=GenerationProbe))
    Path(out).write_bytes(msgspec.json.encode(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
