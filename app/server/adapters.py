"""The LoRA adapters a server serves, by name: vLLM's `--lora-modules name=path` (a request
names one as its model) and llama-server's `--lora FILE` (ids in start order, applied at a
scale to every request that does not choose, and chosen per request by its `lora` field).

A request gets one adapter at most (model/lora.py keeps a slot per token). Loading and
unloading while serving (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter) is allowed
behind VLLM_ALLOW_RUNTIME_LORA_UPDATING, as vLLM allows it. An unloaded adapter's slot is
taken again only once no live request holds it.
"""

import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from app.server.errors import APIError
from model.errors import ModelError
from model.lora import AdapterUse, read_adapter

_loads = itertools.count(1)  # each load's ident: K/V cached under one is never another's


@dataclass
class Served:
    name: str
    path: str
    id: int  # llama-server's: its place in start order
    use: AdapterUse  # its slot, at scale 1 (a request's scale replaces that)
    scale: float = 1.0  # llama-server's: what every request that does not choose gets (0: none)


class Adapters:
    def __init__(self, engine, config, base_name: str, runtime: bool = False):
        self.engine, self.config, self.base_name, self.runtime = engine, config, base_name, runtime
        self.served: dict[str, Served] = {}

    @property
    def slots(self) -> int:
        return self.engine.runner.adapters.slots

    def load(self, name: str, path: str) -> Served:
        """Read and load one at run time (off the event loop: it reads files and copies to the device)."""
        if name in self.served or name == self.base_name:
            raise ModelError(f"a model named {name!r} is already served")
        return self.add(read_adapter(name, path, self.config), 0.0)

    def add(self, adapter, scale: float) -> Served:
        """A read adapter into a free slot, served under its name."""
        if adapter.name in self.served or adapter.name == self.base_name:
            raise ModelError(f"two models are named {adapter.name!r}: give the adapters other names")
        slot = self.free_slot()
        self.engine.runner.load_adapter(adapter, slot)
        ids = [s.id for s in self.served.values()]
        served = Served(adapter.name, adapter.path, max(ids, default=-1) + 1, AdapterUse(slot, 1.0, next(_loads)),
                        scale)
        self.served[adapter.name] = served
        return served

    def unload(self, name: str) -> None:
        if name not in self.served:
            raise APIError(404, f"no LoRA adapter named {name!r} is loaded", param="lora_name",
                           code="model_not_found")
        del self.served[name]

    def free_slot(self) -> int:
        """A slot no served adapter names and no live request still reads."""
        named = {s.use.slot for s in self.served.values()}
        live = {r.params.adapter.slot for r in self.engine.planner.queues.requests.values()
                if r.params.adapter is not None}
        for slot in range(self.slots):
            if slot not in named and slot not in live:
                return slot
        raise ModelError(f"every LoRA slot ({self.slots}, --max-loras) holds an adapter that is served or still"
                         " in use; unload one, or start with a larger --max-loras")

    def check_applied(self) -> None:
        """llama-server applies every --lora at once; Spool applies one a request."""
        applied = [s.name for s in self.served.values() if s.scale]
        if len(applied) > 1:
            raise ModelError(f"LoRA adapters {', '.join(applied)} would all apply to every request; Spool applies"
                             " one a request: pass --lora-init-without-apply and choose one per request (its name"
                             " as the model, or the lora field)")

    def use_for(self, model: str | None, lora: list | None) -> AdapterUse | None:
        """The adapter a request runs with: its lora field's (llama-server's [{"id", "scale"}]),
        else the one its model names, else the one applied to every request, if any."""
        if lora is not None:
            return self._chosen(lora)
        if model in self.served:
            return self.served[model].use
        applied = next((s for s in self.served.values() if s.scale), None)
        if applied is None or model not in (None, "", self.base_name):
            return None
        return AdapterUse(applied.use.slot, applied.scale, applied.use.ident)

    def _chosen(self, lora: list) -> AdapterUse | None:
        by_id = {s.id: s for s in self.served.values()}
        chosen = []
        for entry in lora:
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), int) or entry["id"] not in by_id \
                    or not isinstance(entry.get("scale", 1.0), (int, float)):
                raise APIError(400, f"lora takes [{{\"id\": ID, \"scale\": SCALE}}] with the ids of"
                                    f" /lora-adapters ({sorted(by_id)}); got {entry!r}", param="lora")
            if entry.get("scale", 1.0):
                chosen.append(entry)
        if len(chosen) > 1:
            raise APIError(400, "Spool applies one LoRA adapter a request; give one id a non-zero scale", param="lora")
        if not chosen:
            return None
        s = by_id[chosen[0]["id"]]
        return AdapterUse(s.use.slot, float(chosen[0].get("scale", 1.0)), s.use.ident)

    def listed(self) -> list[dict]:
        """GET /lora-adapters, as llama-server answers it."""
        return [{"id": s.id, "path": s.path, "scale": s.scale} for s in self.served.values()]

    def set_scales(self, body) -> None:
        """POST /lora-adapters: each listed id's global scale, the others' 0 (llama-server's)."""
        if not isinstance(body, list):
            raise APIError(400, 'send [{"id": ID, "scale": SCALE}, ...]', param="lora")
        by_id = {s.id: s for s in self.served.values()}
        scales = {}
        for entry in body:
            if not isinstance(entry, dict) or entry.get("id") not in by_id or \
                    not isinstance(entry.get("scale"), (int, float)):
                raise APIError(400, f"each entry is {{\"id\": ID, \"scale\": SCALE}} with an id of {sorted(by_id)};"
                                    f" got {entry!r}", param="lora")
            scales[entry["id"]] = float(entry["scale"])
        if sum(1 for v in scales.values() if v) > 1:
            raise APIError(400, "Spool applies one LoRA adapter a request; give one id a non-zero scale", param="lora")
        for s in self.served.values():
            s.scale = scales.get(s.id, 0.0)


def requested(args) -> list[tuple[str, str, float]]:
    """(name, path, scale applied to every request) of each adapter the command line gives:
    vLLM's --lora-modules (applied to none) and llama-server's --lora, --lora-scaled (named by
    their file's stem)."""
    out = []
    for module in args.lora_modules or ():
        if module.lstrip().startswith("{"):
            try:
                spec = json.loads(module)
                out.append((spec["name"], spec["path"], 0.0))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {module!r}: give NAME=PATH or {{\"name\": ..., \"path\": ...}}")
            continue
        name, sep, path = module.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {module!r}: give NAME=PATH")
        out.append((name, path, 0.0))
    applied = 0.0 if args.lora_init_without_apply else 1.0
    files = [(f, "1") for f in args.lora or ()] + [tuple(pair) for pair in args.lora_scaled or ()]
    for path, scale in files:
        try:
            out.append((Path(path).stem, path, float(scale) * applied))
        except ValueError:
            raise ValueError(f"--lora-scaled {path} {scale}: the scale is a number") from None
    return out


def start(engine, config, base_name: str, args) -> Adapters | None:
    """The adapters of the command line loaded into the runner's slots (None where LoRA is not
    asked for): as many slots as --max-loras or the adapters given, of the rank of the highest."""
    given = requested(args)
    runtime = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")
    if not given and not args.enable_lora:
        return None
    read = [(read_adapter(name, path, config), scale) for name, path, scale in given]
    rank = max([args.max_lora_rank, *(adapter.rank for adapter, _ in read)])
    engine.runner.serve_adapters(max(args.max_loras, len(read)), rank)
    adapters = Adapters(engine, config, base_name, runtime)
    for adapter, scale in read:
        adapters.add(adapter, scale)
    adapters.check_applied()
    return adapters
