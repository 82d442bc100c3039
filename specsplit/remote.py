"""`specsplit generate --server`: one request through a running target service."""

from __future__ import annotations

from specsplit.shared.sampling import SamplingParams
from specsplit.shared.security import ClientSecurity
from specsplit.target_service.client import TargetClient


def generate_remote(address: str, prompt: str, params: SamplingParams, *, chat: bool,
                    speculative: bool, security: ClientSecurity = ClientSecurity()) -> tuple[list[int], str, dict]:
    client = TargetClient(address, security=security)
    try:
        result = client.generate(prompt, params, chat=chat, speculative=speculative)
    finally:
        client.close()
    return result["token_ids"], result["text"], result["stats"]
