"""A tiny random-weight model whose chat template renders tools the way Qwen 2.5 does.

mlx-lm recognises the template (`<tool_call>` and `tool_call.name`) and gives the tokenizer
its JSON tool parser, so the daemon's tool plumbing runs exactly as for a real tool model.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlxcel.daemon.models.tiny import make_tiny_model

TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are helpful.{% endif %}

# Tools

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

Call a function with <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def make_tool_model(path: Path, seed: int = 0, parser: str | None = None) -> Path:
    """The tiny llama model of `make_tiny_model`, with the tool-capable chat template.

    `parser` names an mlx-lm tool parser to use instead of the one inferred (json_tools).
    """
    model_dir = make_tiny_model(path, "llama", seed=seed)
    (model_dir / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    if parser is not None:
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["tool_parser_type"] = parser
        config_path.write_text(json.dumps(config, indent=2))
    return model_dir
