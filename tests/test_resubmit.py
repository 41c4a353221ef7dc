"""A request resubmitted after a scheduler restart: the new scheduler takes the outputs the
client already has as outputs (`EngineRequest.output_token_ids`), so the rest of the
sequence is the undisturbed one and every output-counting rule (max_tokens, min_tokens,
the worker's output position for penalties and seeded noise) sees the whole output; and the
frontend's engine sockets carry the engine links' frame limit."""

from __future__ import annotations

import random

import pytest
import zmq

from noria.frontend.engine_client import engine_sockets
from noria.protocol.config import EngineAddresses
from noria.protocol.engine import EngineRequest
from noria.protocol.sampling import SamplingParams, engine_params
from noria.protocol.sockets import MAX_ENGINE_MESSAGE
from tests.test_scheduler_basic import EOS, make, reference, run


def _resumed(rid: int, prompt: list[int], outputs: list[int], **params) -> EngineRequest:
    return EngineRequest(rid, prompt, engine_params(SamplingParams(**params)), [EOS], output_token_ids=outputs)


@pytest.mark.parametrize("split", [1, 7, 19])
def test_a_resumed_request_goes_on_as_if_undisturbed(split):
    rng = random.Random(split)
    prompt = [rng.randrange(EOS) for _ in range(13)]
    whole = reference(prompt, 20)
    s, w = make()
    s.add_request(_resumed(0, prompt, whole[:split], max_tokens=20, ignore_eos=True))
    plan = s.schedule()
    (new,) = plan.new_requests
    # The worker learns which tokens are outputs: penalties and seeded noise count from there.
    assert new.num_prompt_tokens == len(prompt) and new.token_ids == prompt + whole[:split]
    s.update_from_result(w.execute(plan))
    done = run(s, w)
    assert done[0] == (whole[split:], "length")  # max_tokens counted the resumed outputs too


def test_min_tokens_and_the_length_limit_count_resumed_outputs():
    prompt = [5, 6, 7]
    whole = reference(prompt, 30)
    stop = whole[5]
    s, w = make()
    # min_tokens 6 counts the 4 resumed outputs: the stop token at output 6 ends it there (counted
    # from the resumption, min_tokens would hold it back until output 10 at least).
    s.add_request(_resumed(0, prompt, whole[:4], max_tokens=30, min_tokens=6, stop_token_ids=[stop]))
    assert run(s, w)[0] == (whole[4:6], "stop")

    s, w = make(max_len=24)
    s.add_request(_resumed(1, prompt, whole[:20], max_tokens=30, ignore_eos=True))  # 3 + 20 of 24: one more token
    assert run(s, w)[1] == (whole[20:21], "length")
    s.add_request(_resumed(2, prompt, whole[:21], max_tokens=30, ignore_eos=True))  # nothing left to generate
    ((_, reason),) = [v for k, v in run(s, w).items() if k == 2]
    assert reason == "error"


def test_the_frontend_engine_sockets_have_the_engine_frame_limit(tmp_path):
    ctx = zmq.Context()
    addrs = EngineAddresses(requests=f"ipc://{tmp_path}/r", outputs=f"ipc://{tmp_path}/o", workers=f"ipc://{tmp_path}/w")
    try:
        for sock in engine_sockets(ctx, addrs):
            assert sock.getsockopt(zmq.MAXMSGSIZE) == MAX_ENGINE_MESSAGE
            assert (sock.getsockopt(zmq.SNDHWM), sock.getsockopt(zmq.RCVHWM), sock.getsockopt(zmq.LINGER)) == (0, 0, 0)
            sock.close()
    finally:
        ctx.term()
