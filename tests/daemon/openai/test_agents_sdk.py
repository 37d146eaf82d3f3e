"""The OpenAI Agents SDK (`openai-agents`), unchanged, running one tool-using agent turn against
the daemon on a tiny random model that thinks (tests/thinking_model.py), through each of
its two model classes: OpenAIChatCompletionsModel (/v1/chat/completions) and
OpenAIResponsesModel (/v1/responses). No network beyond 127.0.0.1 and no trace export.

1. the agent's first model call is forced to call the tool (tool_choice "required"): the
   call's arguments are valid for the tool's schema, so the SDK runs the Python function;
2. the SDK sends the tool's output back (reset_tool_choice: now "auto") and the model's
   answer ends the turn as the agent's final output. Through the Responses API the agent
   declares an output type (its JSON schema is text.format, structured output): the SDK
   treats an answer cut at max_output_tokens (status "incomplete") as an error, and the
   random model's free text rarely ends by itself; the schema makes the answer end."""

from __future__ import annotations

from typing import Literal

import pydantic
import pytest

agents = pytest.importorskip("agents")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module", autouse=True)
def no_tracing():
    agents.set_tracing_disabled(True)
    yield


class Forecast(pydantic.BaseModel):
    sky: Literal["sunny", "rainy"]


def _agent(model, calls: list[str], output_type=None):
    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    return agents.Agent(
        name="forecaster", instructions="Use the tool, then answer.", tools=[get_weather],
        model=model, output_type=output_type, model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=300,
            temperature=0))


@pytest.mark.parametrize("kind", ["chat_completions", "responses"])
def test_one_tool_using_turn(thinking_server, model_dir_name, kind):
    client = openai.AsyncOpenAI(base_url=thinking_server.url + "/v1", api_key="unused",
                                max_retries=0, timeout=60)
    model_class = (agents.OpenAIChatCompletionsModel if kind == "chat_completions"
                   else agents.OpenAIResponsesModel)
    calls: list[str] = []
    output_type = Forecast if kind == "responses" else None
    agent = _agent(model_class(model=model_dir_name, openai_client=client), calls, output_type)
    result = agents.Runner.run_sync(agent, "What is the weather in Oslo?", max_turns=3)
    kinds = [type(item).__name__ for item in result.new_items]
    assert "ToolCallItem" in kinds and "ToolCallOutputItem" in kinds, kinds
    assert len(calls) == 1 and calls[0] in ("Paris", "Oslo")
    [output] = [i for i in result.new_items if type(i).__name__ == "ToolCallOutputItem"]
    assert output.output == f"sunny in {calls[0]}"
    assert isinstance(result.final_output, output_type or str)
    assert len(result.raw_responses) == 2   # the call, then the answer with its result
