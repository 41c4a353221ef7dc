"""Engine flags are typed: bad values fail once, through msgspec, with an error that names the flag."""

from __future__ import annotations

import msgspec
import pytest

from noria.frontend.bridge.openai_schema import ChatRequest, CompletionRequest
from noria.frontend.cli import main as cli_main
from noria.frontend.startup import make_config
from noria.protocol.config import EngineConfig
from noria.protocol.errors import ParamError
from noria.protocol.validation import field_error

DTYPES = ["auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_alias_is_accepted(dtype):
    assert make_config("demo", dtype=dtype).dtype == dtype


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_every_block_size_is_accepted(block_size):
    assert make_config("demo", block_size=block_size).block_size == block_size


@pytest.mark.parametrize(
    "flags, param",
    [
        ({"block_size": 7}, "block_size"),
        ({"block_size": 256}, "block_size"),
        ({"dtype": "f8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"preemption_mode": "drop"}, "preemption_mode"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"swap_space": -1}, "swap_space"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"kv_cache_memory": 0}, "kv_cache_memory"),
        ({"num_threads": 0}, "num_threads"),
        ({"seed": "0"}, "seed"),
    ],
)
def test_bad_values_name_the_flag(flags, param):
    with pytest.raises(ParamError) as e:
        make_config("demo", **flags)
    assert e.value.param == param and param in e.value.message
    assert isinstance(e.value, ValueError)


def test_unknown_flags_and_the_api_key_are_not_engine_flags():
    # The key is not an engine flag: EngineConfig travels to every child on its command line.
    assert "api_key" not in EngineConfig.__struct_fields__
    with pytest.raises(TypeError, match="api_key"):
        make_config("demo", api_key="x")


def test_children_reject_a_bad_config_when_decoding_it():
    # What `python -m noria.scheduler --config JSON` does with its argument.
    good = msgspec.json.encode(make_config("demo"))
    assert msgspec.json.decode(good, type=EngineConfig).block_size == 16
    with pytest.raises(msgspec.ValidationError, match="block_size"):
        msgspec.json.decode(good.replace(b'"block_size":16', b'"block_size":12'), type=EngineConfig)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["serve", "--block-size", "12"], "--block-size"),
        (["serve", "--dtype", "f8"], "--dtype"),
        (["generate", "x", "--device", "tpu"], "--device"),
        (["serve", "--api-key", "a", "--api-key-file", "b"], "--api-key-file"),
        (["serve", "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 2}'],
         "--speculative-config"),
    ],
)
def test_the_cli_rejects_bad_choices_before_starting_anything(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_a_bad_number_is_reported_by_the_cli(capsys):
    assert cli_main(["generate", "x", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kind, raw, param",
    [
        (CompletionRequest, {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        (CompletionRequest, {"prompt": "x", "stop": [1]}, "stop"),
        (CompletionRequest, {"max_tokens": 3}, "prompt"),  # required
        (ChatRequest, {"messages": "hi"}, "messages"),
        (ChatRequest, {"messages": [], "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ],
)
def test_a_body_that_does_not_fit_names_its_field(kind, raw, param):
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(raw, kind)
    assert field_error(kind, raw).param == param


def test_a_body_that_fits_names_nothing():
    assert field_error(CompletionRequest, {"prompt": "x", "max_tokens": 3}) is None
    assert field_error(CompletionRequest, [1, 2]) is None
