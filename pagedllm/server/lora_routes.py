"""vLLM's runtime LoRA endpoints, mounted only with --allow-runtime-lora-updating (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING): POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
POST /v1/unload_lora_adapter {"lora_name"}. Success is a 200 with one line of text, as vLLM's; an
adapter that cannot be served is a 400 naming it, an unknown name to unload a 404, both in
OpenAI's error shape. What happens to requests in flight: server/lora_modules.py."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from pagedllm.server.async_engine import AsyncEngine, EngineDeadError
from pagedllm.server.errors import short_repr
from pagedllm.server.lora_modules import LoRAModules
from pagedllm.server.protocol import APIError


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's body may carry it; the name decides


def lora_router(loras: LoRAModules, engine: AsyncEngine, base_name: str) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        name = body.lora_name
        if name == base_name or loras.get(name) is not None:
            raise APIError(f"LoRA adapter {short_repr(name)}: the name is taken (unload it first, or "
                           "choose another)", param="lora_name")
        try:
            lora = loras.new_request(name, body.lora_path)
            await engine.load_lora(lora)  # the core reads and checks it (ValueError: it cannot)
            loras.add(lora)
        except ValueError as exc:
            raise APIError(str(exc), param="lora_path") from exc
        except EngineDeadError as exc:
            raise APIError(str(exc), 503) from exc
        return f"Success: LoRA adapter '{name}' added successfully."

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        if not loras.remove(body.lora_name):
            raise APIError(f"LoRA adapter {short_repr(body.lora_name)} is not loaded", 404,
                           param="lora_name", code="model_not_found")
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    return router
