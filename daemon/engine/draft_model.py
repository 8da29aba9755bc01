"""Drafting with a second, smaller model of the same tokenizer (`--speculative draft`).

`DraftModel` proposes each decoding row's next tokens by greedy decoding with the draft model;
`BatchRunner._speculate` verifies them exactly as it verifies prompt-lookup drafts
(`RowBatch.verify_step`: exactness does not depend on who drafted). The drafting is batched
like the main model's decode: the rows that draft keep their draft-model KV in one
`BatchKVCache` per layer, in the order of `uids`.

Each drafting step:
1. rows that stopped drafting leave the batch (`filter`); rows new to it run their context but
   its last token through the draft model, alone, `join_budget` tokens a step for all of them
   (a long agent context does not stall the other rows' step), and join (`extend`) once they
   have caught up, drafting nothing until then;
2. each row's draft KV is cut back to the longest prefix it shares with the row's real context
   (the tokens the main model rejected go; the common part by `trim`, each row's surplus by
   rolling it into its left padding, as the main cache's rollback does);
3. one forward feeds every row its context's tokens the draft model has not seen (right-padded
   to the longest), and greedy picks the first drafted token at each row's last position;
4. `k - 1` one-token forwards draft the rest, lazily, evaluated once at the end.

The draft model's KV is not counted in the KV block budget (it is the draft model's, and small
beside the main model's); it is freed when a row leaves the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlxcel.daemon.engine.mlx_support import drop_last_positions

PREFILL_CHUNK = 512  # context tokens rows new to drafting run through the draft model a step


class DraftModelError(ValueError):
    """The draft model cannot draft for this model; the message says why."""


def check_pair(main_tokenizer: Any, draft_tokenizer: Any, draft_model: Any) -> None:
    """Refuse a draft model that does not share the main model's tokenizer (the vocabularies
    differ: the first difference is named) or whose cache is not a plain KV cache (sliding
    windows, state-space layers: its drafts could not be rolled back)."""
    main_vocab, draft_vocab = _vocab(main_tokenizer), _vocab(draft_tokenizer)
    if main_vocab != draft_vocab:
        raise DraftModelError(
            f"the draft model's tokenizer differs: {_difference(main_vocab, draft_vocab)}"
        )
    kinds = {type(c).__name__ for c in make_prompt_cache(draft_model)}
    if kinds != {"KVCache"}:
        raise DraftModelError(
            f"the draft model keeps a {', '.join(sorted(kinds))} cache: only a plain KV cache "
            "can be rolled back past rejected drafts"
        )


def _vocab(tokenizer: Any) -> dict[str, int]:
    return dict(tokenizer.get_vocab())  # mlx-lm's TokenizerWrapper passes it to the HF one


def _difference(main: dict[str, int], draft: dict[str, int]) -> str:
    """The first token whose id differs, in id order (main model's), or what is missing."""
    for token, tid in sorted(main.items(), key=lambda kv: kv[1]):
        other = draft.get(token)
        if other is None:
            return f"token {token!r} (id {tid}) is not in the draft model's vocabulary"
        if other != tid:
            return f"token {token!r} is id {tid} for the model and id {other} for the draft model"
    extra = sorted(set(draft) - set(main), key=lambda t: draft[t])
    first = extra[0]
    return f"the draft model has {len(extra)} more tokens, the first {first!r} (id {draft[first]})"


@dataclass
class _Joining:
    """A row catching up with its context in the draft model, before it joins the batch."""

    caches: list[Any]  # the draft model's per-layer KVCache
    fed: list[int] = field(default_factory=list)


class DraftModel:
    """A draft model and the draft KV of the rows that draft with it (see the module doc)."""

    def __init__(self, model: Any, vocab_size: int, join_budget: int = PREFILL_CHUNK) -> None:
        """`vocab_size`: the main model's; a drafted id at or beyond it ends that draft.
        `join_budget`: context tokens the rows new to drafting run through the draft model
        in one step, together."""
        self.model = model
        self.vocab_size = vocab_size
        self.join_budget = join_budget
        self.uids: list[str] = []
        self.fed: list[list[int]] = []  # per row: the tokens whose KV the draft cache holds
        self.caches: list[BatchKVCache] = []  # per layer, rows in the order of `uids`
        self.joining: dict[str, _Joining] = {}  # rows still catching up, by uid

    def keep_only(self, uids: Sequence[str]) -> None:
        """Drop the draft KV of rows not in `uids` (no longer decoding, or not drafting)."""
        live = set(uids)
        for uid in [u for u in self.joining if u not in live]:
            del self.joining[uid]
        keep = [j for j, u in enumerate(self.uids) if u in live]
        if len(keep) == len(self.uids):
            return
        if not keep:
            self.uids, self.fed, self.caches = [], [], []
            return
        for c in self.caches:
            c.filter(keep)
        self.uids = [self.uids[j] for j in keep]
        self.fed = [self.fed[j] for j in keep]

    def reset(self) -> None:
        """Forget every row (after a failed step, or when drafting is switched off)."""
        self.uids, self.fed, self.caches = [], [], []
        self.joining.clear()

    @property
    def rows(self) -> int:
        """Rows holding draft KV: drafting, or catching up to draft."""
        return len(self.uids) + len(self.joining)

    def draft(
        self, uids: Sequence[str], contexts: Sequence[Sequence[int]], lengths: Sequence[int]
    ) -> list[list[int]]:
        """Up to `lengths[i]` tokens for each row `uids[i]`, whose whole context (prompt,
        output and pending input) is `contexts[i]`. A row with a length of 0 drafts nothing
        and leaves the draft batch; a row new to it drafts nothing until its context has run
        through the draft model (`join_budget` tokens a step)."""
        wanted = [i for i, n in enumerate(lengths) if n > 0]
        drafts: list[list[int]] = [[] for _ in uids]
        self.keep_only([uids[i] for i in wanted])
        self._catch_up([uids[i] for i in wanted], [contexts[i] for i in wanted])
        position = {uids[i]: i for i in wanted}
        rows = [position[u] for u in self.uids]  # input row of each draft batch row
        if not rows:
            return drafts
        unseen = self._roll_back([contexts[i] for i in rows])
        steps = max(lengths[i] for i in rows)
        tokens = self._decode(unseen, steps)
        for j, i in enumerate(rows):
            draft = tokens[j][: lengths[i]]
            cut = next((e for e, t in enumerate(draft) if t >= self.vocab_size), len(draft))
            drafts[i] = draft[:cut]
            self.fed[j].extend(unseen[j])
            self.fed[j].extend(tokens[j][: steps - 1])
        return drafts

    def _catch_up(self, uids: list[str], contexts: list[Sequence[int]]) -> None:
        """Rows not in the draft batch run their context but its last token through the draft
        model, alone, up to `join_budget` tokens in all; a row that has caught up joins."""
        budget = self.join_budget
        have = set(self.uids)
        for uid, context in zip(uids, contexts, strict=True):
            if uid in have:
                continue
            row = self.joining.get(uid)
            if row is None:
                row = self.joining[uid] = _Joining(make_prompt_cache(self.model))
            target = len(context) - 1
            while len(row.fed) < target and budget > 0:
                chunk = list(context[len(row.fed) : min(target, len(row.fed) + budget)])
                self.model(mx.array([chunk]), cache=row.caches)
                mx.eval([c.state for c in row.caches])
                row.fed.extend(chunk)
                budget -= len(chunk)
            if len(row.fed) == target:
                self._join(uid, self.joining.pop(uid))

    def _join(self, uid: str, row: _Joining) -> None:
        """A row that has caught up joins the draft batch."""
        merged = [
            BatchKVCache.merge([c]) if c.keys is not None else BatchKVCache([0]) for c in row.caches
        ]
        if self.caches:
            for mine, other in zip(self.caches, merged, strict=True):
                mine.extend(other)
        else:
            self.caches = merged
        self.uids.append(uid)
        self.fed.append(row.fed)

    def _roll_back(self, contexts: list[Sequence[int]]) -> list[list[int]]:
        """Each row's draft KV cut back to the prefix it shares with its context (at least one
        context token left unseen); returns each row's unseen tokens."""
        drop, unseen = [], []
        for j, context in enumerate(contexts):
            fed = self.fed[j]
            common = _common_prefix(fed, context)
            common = min(common, len(context) - 1)
            drop.append(len(fed) - common)
            del fed[common:]
            unseen.append(list(context[common:]))
        drop_last_positions(self.caches, drop)
        return unseen

    def _decode(self, unseen: list[list[int]], steps: int) -> list[list[int]]:
        """Every row fed its unseen tokens (right-padded), then `steps` greedy tokens each
        (the last one not fed)."""
        lengths = [len(u) for u in unseen]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        if max(padding):
            for c in self.caches:
                c.prepare(lengths=lengths, right_padding=padding)
        inputs = mx.array([u + [0] * (longest - len(u)) for u in unseen])
        logits = self.model(inputs, cache=self.caches)
        if max(padding):
            for c in self.caches:
                c.finalize()
        last = logits[mx.arange(len(unseen)), mx.array([n - 1 for n in lengths])]
        token = mx.argmax(last, axis=-1)
        out = [token]
        for _ in range(steps - 1):
            token = mx.argmax(self.model(token[:, None], cache=self.caches)[:, -1, :], axis=-1)
            out.append(token)
        drafted = mx.stack(out, axis=1)
        mx.eval(drafted, [c.state for c in self.caches])
        return drafted.tolist()


def _common_prefix(a: list[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix (binary search over slice comparisons: each
    runs in C, and the usual mismatch sits near the end of a long context)."""
    n = min(len(a), len(b))
    b = b if isinstance(b, list) else list(b)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
