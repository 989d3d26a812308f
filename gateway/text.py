"""A model's tokenizer in the gateway (shell: reads a GGUF's metadata; no torch, no tensors).

Why the gateway tokenises itself instead of asking a coordinator: the router compares a prompt's chain
hashes with the prefixes coordinators advertise, so it needs the prompt's token ids before it picks a
coordinator. Asking one for them would add a round trip to every request and make routing depend on the
coordinator it is trying to choose; the tokenizer is in the GGUF's metadata, and the coordinator's own code
(``swarm.text.tokenizer``, ``swarm.text.chat``) gives the same ids from the same file.

Rules:
- ``--model PATH`` gives the gateway a model's GGUF; its id is the coordinators' (DESIGN §11: file stem +
  12 hex digits of its sha256), so a file that is not the model's never matches its requests.
- Prompts render and tokenise exactly as the coordinator's API does (chat template without a second bos,
  special tokens parsed); a request the gateway cannot tokenise is routed without prefix locality (the
  coordinator gives its own 4xx for bad input).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.errors import ConfigError
from swarm.text.chat import render_chat
from swarm.text.tokenizer import Tokenizer

__all__ = ["ModelText", "load_model_text"]


@dataclass(frozen=True)
class ModelText:
    model_id: str
    tokenizer: Tokenizer
    template: str | None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, parse_special=True)

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        tok = self.tokenizer
        bos_text = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        msgs = [{**m, "content": m.get("content") or ""} for m in messages]
        text = render_chat(self.template, msgs, add_generation_prompt=True, bos_token=bos_text,
                           eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "")
        if tok.add_bos and bos_text and text.startswith(bos_text):
            text = text[len(bos_text):]  # the template wrote the bos the tokenizer adds: once (as the coordinator)
        return self.encode(text)


def load_model_text(path: Path) -> ModelText:
    import gguf

    try:
        reader = gguf.GGUFReader(path, "r")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {path}: cannot read the GGUF: {exc}", code="bad_model") from exc
    fields: dict[str, Any] = {}
    for k, f in reader.fields.items():
        try:
            fields[k] = f.contents()
        except Exception:  # noqa: BLE001 - a field we cannot decode is just absent (as in swarm.model.gguf)
            continue
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    template = fields.get("tokenizer.chat_template")
    return ModelText(f"{path.stem}-{h.hexdigest()[:12]}", Tokenizer.from_gguf_fields(fields),
                     template if isinstance(template, str) else None)
