"""The openai-agents SDK's default model (`OpenAIResponsesModel`, the Responses API) runs an
Agent with a function tool end to end against a live `noria serve`, whole and streamed.

The demo model is random: tool_choice "required" on the first turn makes it call the tool
(its arguments valid under the tool's schema whatever it samples); the SDK then resets
tool_choice (`reset_tool_choice`) and the model answers under the agent's output type (a
`text.format` json_schema, which also ends the answer before max_tokens does), and the run ends.
The run must have called the real Python function with the model's arguments and fed its result
back."""

from __future__ import annotations

import asyncio
import shutil
from typing import Annotated

import pydantic
import pytest

agents = pytest.importorskip("agents")  # the `test` extra installs openai-agents

from openai import AsyncOpenAI  # noqa: E402

from tests.procs import serve_http  # noqa: E402
from tests.test_tool_calls import TEMPLATE  # noqa: E402


@pytest.fixture(scope="module")
def served(demo_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("agents-model") / "m"
    shutil.copytree(demo_path, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    with serve_http("--model", str(path), "--num-kv-blocks", "256", "--enable-auto-tool-choice",
                    "--tool-call-parser", "hermes") as s:
        yield s.http, str(path)


class Answer(pydantic.BaseModel):
    summary: str = pydantic.Field(max_length=12)


def _agent(served, calls: list[str]):
    http, model = served
    agents.set_tracing_disabled(True)  # no exporter: nothing leaves the machine

    @agents.function_tool
    def get_weather(city: Annotated[str, pydantic.Field(max_length=8)]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    client = AsyncOpenAI(base_url=f"{http}/v1", api_key="agents-key", max_retries=0, timeout=120)
    return agents.Agent(
        name="weather", instructions="Use the tool, then answer.", tools=[get_weather], output_type=Answer,
        model=agents.OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=80, temperature=0.0),
    )


def _check(result, calls: list[str]) -> None:
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", kinds
    assert len(calls) == 1 and result.new_items[1].output == f"sunny in {calls[0]}"
    assert isinstance(result.final_output, Answer)
    assert len(result.raw_responses) == 2 and all(r.response_id.startswith("resp_") for r in result.raw_responses)


def test_agent_with_a_function_tool_runs_end_to_end(served):
    calls: list[str] = []
    result = asyncio.run(agents.Runner.run(_agent(served, calls), "What is the weather in Paris?", max_turns=4))
    _check(result, calls)


def test_agent_streamed(served):
    calls: list[str] = []

    async def run():
        result = agents.Runner.run_streamed(_agent(served, calls), "What is the weather in Paris?", max_turns=4)
        deltas = []
        async for ev in result.stream_events():
            if ev.type == "raw_response_event" and ev.data.type == "response.output_text.delta":
                deltas.append(ev.data.delta)
        return result, "".join(deltas)

    result, text = asyncio.run(run())
    _check(result, calls)
    assert Answer.model_validate_json(text) == result.final_output
