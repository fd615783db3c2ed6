"""The client for an auxiliary model (`auxiliary.<task>` config; unset fields fall back to `llm`).

The main client is reused when only the model name differs (a per-call override); a
different endpoint, key or timeout gets a client of its own that the caller closes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.llm import LLMClient

if TYPE_CHECKING:
    from core.settings import AuxModelConfig, LLMConfig


@dataclass
class AuxTarget:
    client: LLMClient
    model: str | None  # per-call model override on a shared client
    owned: bool  # a client made for this call: close it afterwards
    distinct: bool  # differs from the main model (a failure may retry on the main model)

    async def aclose(self) -> None:
        if self.owned:
            await self.client.aclose()


def aux_target(aux: AuxModelConfig, main: LLMConfig, main_client: LLMClient) -> AuxTarget:
    """Where requests for an auxiliary task go."""
    base = aux.base_url or main.base_url
    model = aux.model or main_client.model
    key_env = aux.api_key_env or main.api_key_env
    timeout = aux.timeout_s or main.timeout_s
    distinct = base != main.base_url or model != main_client.model or key_env != main.api_key_env
    if base == main.base_url and key_env == main.api_key_env and timeout == main.timeout_s:
        return AuxTarget(main_client, model if model != main_client.model else None, False, distinct)
    client = LLMClient(
        base,
        model,
        api_key=os.environ.get(key_env) if key_env else None,
        timeout_s=timeout,
        max_retries=main.max_retries,
    )
    return AuxTarget(client, None, True, distinct)


__all__ = ["AuxTarget", "aux_target"]
