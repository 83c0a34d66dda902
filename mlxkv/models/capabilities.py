"""What a model can do with tools, thinking and images, read from what its chat template,
tokenizer and config actually do, not from what an API allows: SmolLM2's template drops the
tools it is given (its prompt is the same 42 tokens with or without them), so it does not
"have" tools, whatever a request may send.

Owns `Capabilities` and `model_capabilities`, which `/api/show`, `/v1/models` and `mlxkv info`
report alike, and `TemplateFacts` (`read_template_facts`: the same read from a local model's
tokenizer files and config before its weights are loaded).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from mlxkv.models.encoder import is_encoder_model
from mlxkv.models.vision import is_vision_model

logger = logging.getLogger(__name__)

# A tool no template would name by chance: found in the render, the template shows tools.
_PROBE_NAME = "mlxkv_capability_probe_7f3a"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": _PROBE_NAME,
        "description": "Probe.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}
_PROBE_MESSAGES = [{"role": "user", "content": "Hi"}]


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """Attributes:
    tools: the chat template shows the model the tools a request sends.
    tool_call_format: mlx-lm's parser of the calls the model writes (e.g. "json_tools"), by
        its template; None: none known (a call it writes comes back as text).
    thinking: its vocabulary has thinking tags (its thinking is returned apart).
    forced_tool_calls: a `tool_choice` that requires a call returns one whose arguments
        validate (a grammar keeps the reply to it): every model, through llguidance.
    vision: the model takes images (a vision-language model through mlx-vlm); Ollama's
        word, which its clients read before they send images.
    """

    tools: bool
    tool_call_format: str | None
    thinking: bool
    forced_tool_calls: bool = True
    generates: bool = True
    vision: bool = False

    def names(self, ollama: bool = False) -> list[str]:
        """The capabilities by name (`/v1/models`, `mlxkv info`); `ollama`: only those in
        Ollama's list (`/api/show`), which has no word for forced calls. A model that does not
        generate (an encoder) is an "embedding" model, as Ollama lists one."""
        if not self.generates:
            return ["embedding"]
        named = {
            "completion": True,
            "tools": self.tools,
            "forced_tool_calls": self.forced_tool_calls and not ollama,
            "thinking": self.thinking,
            "vision": self.vision,
        }
        return [name for name, held in named.items() if held]


def model_capabilities(
    tokenizer: Any, generates: bool = True, vision: bool = False
) -> Capabilities:
    """What `tokenizer`'s model (mlx-lm's TokenizerWrapper) can do, from one render of its
    chat template with a probe tool; nothing but embeddings for a model that does not
    `generate` (an encoder: its tokenizer is mlx-embeddings'); `vision`: it takes images."""
    if not generates:
        return Capabilities(
            tools=False,
            tool_call_format=None,
            thinking=False,
            forced_tool_calls=False,
            generates=False,
        )
    parser = getattr(tokenizer, "tool_parser", None) if tokenizer.has_tool_calling else None
    format_name = (getattr(parser, "__module__", "") or "").rpartition(".")[2] or None
    return Capabilities(
        tools=_template_shows_tools(tokenizer),
        tool_call_format=format_name,
        thinking=bool(tokenizer.has_thinking),
        vision=vision,
    )


@dataclass(frozen=True, kw_only=True)
class TemplateFacts:
    """What a model's tokenizer files and config say, read without its weights.

    Attributes:
        capabilities: as `model_capabilities` finds them once the model is loaded.
        chat_template: its chat template ("" for none).
        model_type: its config's `model_type`.
    """

    capabilities: Capabilities
    chat_template: str
    model_type: str


def read_template_facts(path: str | Path | None) -> TemplateFacts | None:
    """A local model directory's `TemplateFacts`, from its tokenizer files and config.json
    alone (a served model's listings before its first load); None for anything else (a GGUF
    file, a repo id, an Ollama name) or files that cannot be read (the load says why)."""
    from mlx_lm.utils import load_tokenizer

    folder = Path(path).expanduser() if path else None
    if folder is None or not (folder / "config.json").is_file():
        return None
    try:
        config = json.loads((folder / "config.json").read_text())
        if not isinstance(config, dict):
            raise TypeError(f"config.json holds a {type(config).__name__}, not an object")
        if is_encoder_model(config):
            return TemplateFacts(
                capabilities=model_capabilities(None, generates=False),
                chat_template="",
                model_type=config["model_type"],
            )
        tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    except Exception as error:  # transformers and huggingface_hub raise their own classes
        # (an invalid config is a StrictDataclassError): a listing must not fail for it
        logger.debug("tokenizer of %s not read before loading: %s", folder, error)
        return None
    template = getattr(tokenizer, "chat_template", None) or ""
    capabilities = model_capabilities(tokenizer, vision=is_vision_model(config))
    return TemplateFacts(
        capabilities=capabilities,
        chat_template=template,
        model_type=config.get("model_type", ""),
    )


def _template_shows_tools(tokenizer: Any) -> bool:
    if not getattr(tokenizer, "chat_template", None):
        return False
    try:
        rendered = tokenizer.apply_chat_template(
            _PROBE_MESSAGES, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True
        )
    except (TemplateError, TypeError, ValueError) as error:  # a template that refuses tools
        logger.debug("chat template refused a tool: %s", error)
        return False
    return _PROBE_NAME in rendered
