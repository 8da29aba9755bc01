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


# --- a thinking model ---------------------------------------------------------------------

THINK_START, THINK_END = "<think>", "</think>"
# Qwen3's shape: the reasoning of earlier assistant turns is dropped from the history;
# `enable_thinking=false` renders an empty, closed reasoning; `think_open` (DeepSeek-R1's
# shape) opens `<think>` in the generation prompt, so the output starts inside the reasoning.
THINK_TEMPLATE = """{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{{ message.content.split('</think>')[-1].lstrip('\\n') }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>{% elif think_open is defined and think_open %}<think>{% endif %}
{%- endif %}"""
# What the thinking model says, greedily: each token's successor. After the generation
# prompt's newline: `<think>XZ</think>QJ` and the end of turn.
THINK_SCRIPT = (
    ("\n", THINK_START),
    (THINK_START, "X"),
    ("X", "Z"),
    ("Z", THINK_END),
    (THINK_END, "Q"),
    ("Q", "J"),
    ("J", "<|im_end|>"),
)
SCRIPT_LOGIT = 4.0  # the successor's logit is 8x this; any other token's is about +-1x this


def make_think_model(path: Path, special: bool = False) -> Path:
    """A tiny llama whose vocabulary has `<think>` and `</think>` (added tokens, as Qwen3's)
    and whose chat template uses them (THINK_TEMPLATE); its weights make it a bigram model:
    every layer adds nothing to the residual (o_proj and down_proj are zero), so the logits
    depend on the current token only, and the head makes THINK_SCRIPT's successor the greedy
    choice. So greedy output is `<think>XZ</think>QJ`, and `logit_bias` steers it.
    `special`: the tags are special tokens too (as gpt-oss's harmony markers are), which the
    daemon skips when it renders text."""
    import mlx.core as mx
    from tokenizers import Tokenizer

    model_dir = make_tiny_model(path, "llama", seed=0, added_tokens=(THINK_START, THINK_END))
    (model_dir / "chat_template.jinja").write_text(THINK_TEMPLATE)
    if special:
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["additional_special_tokens"] = [THINK_START, THINK_END]
        config_path.write_text(json.dumps(config, indent=2))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def token_id(text: str) -> int:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert len(ids) == 1, (text, ids)
        return ids[0]

    file = str(model_dir / "model.safetensors")
    weights = dict(mx.load(file))
    for name, value in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(value)
    embed = weights["model.embed_tokens.weight"]
    unit = embed / mx.linalg.norm(embed, axis=-1, keepdims=True)
    head = mx.zeros_like(weights["lm_head.weight"])
    for src, dst in THINK_SCRIPT:
        s, d = token_id(src), token_id(dst)
        head[d] = head[d] + SCRIPT_LOGIT * unit[s]
    weights["lm_head.weight"] = head
    mx.eval(weights)
    mx.save_safetensors(file, weights, metadata={"format": "mlx"})
    return model_dir
