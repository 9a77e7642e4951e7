"""A rollout server: one engine on one GPU of its own (the native one, or vLLM's: --engine vllm), sampling rounds for
a trainer elsewhere (issue 51). Its program is `python -m qerl.rollout_server` (qerl/rollout_server.py, which reads its
flags before importing torch).

Our own small server around the colocated backend's `VLLMEngine` rather than stock `vllm serve`: the adapter comes
as tensors in memory (vLLM's server only loads LoRA from a folder, and refuses trainable norms), the norm scales
stay FP32 (an out-of-tree op registered in this process, which vLLM's worker processes would not see), and AQN comes
as a seed that this process turns into the trainer's noise on the engine's own norms (qerl/rollout/wire.py). N
single-GPU servers rather than vLLM's data parallel: an adapter loaded through one request reaches one replica there.

`RolloutServer` is the server with the engine injected (anything with VLLMEngine's `model`, `load_lora`, `load_norms`
and `generate`: qerl/rollout/native/server_engine.py's NativeServerEngine too), so the tests run it on the CPU;
`make_http_server` puts it on HTTP (stdlib only: five calls, JSON and one safetensors blob); `serve` builds the engine
and serves it.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import torch
from torch import nn

from qerl.errors import UsageError, one_line
from qerl.norms import find_norms
from qerl.rollout.base import truncate_at_eos
from qerl.rollout.wire import (
    PROTOCOL,
    RoundRequest,
    RoundResult,
    adapter_digest,
    base_fingerprint,
    decode_adapter,
    norms_digest,
)

logger = logging.getLogger(__name__)


class ServerEngine(Protocol):
    """What the server needs of an engine; qerl.rollout.vllm.VLLMEngine and NativeServerEngine have it. An engine
    that can read its LoRA back also has `lora_held(names)` (NativeServerEngine; vLLM's slots are not read): the
    tensors it samples with, of which the server then takes the adapter's digest, instead of those it received."""

    model: nn.Module  # holds the RMSNorms that load_norms fills and AQN perturbs

    def load_lora(self, tensors: dict[str, torch.Tensor], settings: dict[str, Any]) -> None: ...

    def load_norms(self, norms: dict[str, torch.Tensor]) -> None: ...

    def generate(
        self, prompt_ids: list[list[int]], sampling: dict[str, Any]
    ) -> list[tuple[list[int], list[float]]]: ...


class Refused(UsageError):
    """A request the server turns down: its HTTP status, a one-line reason, and fields the client reads."""

    def __init__(self, status: int, message: str, **fields):
        super().__init__(message)
        self.status, self.fields = status, fields


class RolloutServer:
    """The server's state and its operations (put_adapter, relabel, generate), one at a time under one lock: an
    adapter is never swapped while a round samples. `info` takes no lock, so that a trainer can look during a round."""

    def __init__(self, engine: ServerEngine, model_path: str, *, lora_rank: int, seed: int, name: str = ""):
        self.engine, self.model_path, self.lora_rank, self.seed = engine, model_path, lora_rank, seed
        self.fingerprint = base_fingerprint(model_path)
        self.name = name or socket.gethostname()
        # Found once, before any round: info() runs during rounds, when the norms are noisy (or swapped for a copy).
        self.norm_keys = sorted(find_norms(engine.model).keyed(include_final=True, include_heads=True))
        self.held: tuple[int, str] | None = None  # (version, digest) of the adapter the engine holds
        self.reads_lora_back = hasattr(engine, "lora_held")
        self.lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        version, digest = self.held or (None, None)
        return {
            "protocol": PROTOCOL,
            "base": {"path": self.model_path, "fingerprint": self.fingerprint},
            "lora_rank": self.lora_rank,
            "seed": self.seed,
            "norm_keys": self.norm_keys,
            "held": None if version is None else {"version": version, "digest": digest},
            "lora_digest_of": "held" if self.reads_lora_back else "received",
            "torch": torch.__version__,
        }

    def put_adapter(self, blob: bytes) -> dict[str, Any]:
        """Load an adapter; its digest is taken of the norms as the engine holds them, and of the LoRA as it holds it
        where it can read it back (else as received): the trainer compares it with its own, bit for bit."""
        snap = decode_adapter(blob)
        with self.lock:
            self.held = None  # a load that fails half way leaves an adapter no version names
            self.engine.load_lora(snap.lora, snap.settings)
            self.engine.load_norms(snap.norms)
            lora = self.engine.lora_held(list(snap.lora)) if self.reads_lora_back else snap.lora
            self.held = (snap.version, adapter_digest(lora, self._norms_held(snap.norms)))
        # What a sync costs: the adapter's bytes, never the base's (issue 51's measure of it)
        logger.info("adapter v%d: %.1f MB received, digest %s", snap.version, len(blob) / 1e6, self.held[1][:12])
        return {"version": self.held[0], "digest": self.held[1]}

    def relabel(self, version: int, digest: str) -> dict[str, Any]:
        """Name the adapter held `version` when it is the one of `digest`: an optimizer step that left the adapter as
        it was (a learning rate of 0) costs no second upload."""
        with self.lock:
            held = self.held[1] if self.held else None
            if held != digest:
                raise Refused(409, f"holds adapter digest {str(held)[:12]}, not {digest[:12]}: send it whole")
            self.held = (version, digest)
        logger.info("adapter v%d: the one held, relabelled (digest %s)", version, digest[:12])
        return {"version": version, "digest": digest}

    def generate(self, request: RoundRequest) -> RoundResult:
        """Sample a round under its AQN, as `aqn.NoisyRound` does for the colocated vllm backend."""
        spec, model = request.noise, self.engine.model
        with self.lock:
            held = self.held[0] if self.held else None
            if held != request.adapter_version:
                raise Refused(
                    409,
                    f"holds adapter v{held}, round {request.round} asked for v{request.adapter_version}",
                    held=held,
                    asked=request.adapter_version,
                )
            noise = spec.round_noise()
            with noise.of_round(model, spec.sigma, spec.round, fp32_compute=False) as stats:
                digest = norms_digest(model, noise)
                samples = self.engine.generate(request.prompt_ids, request.sampling)
        # The trainer's stop ids came in the sampling settings (vLLM's stop_token_ids): one list, the trainer's, for
        # both vLLM's stop and the cut, where a server flag of its own could disagree with the trainer's tokenizer.
        stop = request.sampling.get("stop_token_ids", [])
        out = truncate_at_eos([ids for ids, _ in samples], [lps for _, lps in samples], stop)
        return RoundResult(out.completion_ids, out.logprobs, held, stats, digest, self.name)

    def _norms_held(self, sent: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The engine's norms, read back in the dtypes they were sent in: FP32 masters come back whole only from FP32
        scales, so an engine that rounded them to BF16 (no FP32 norms: AQN's small noise would be lost) shows as a
        digest mismatch."""
        params = dict(self.engine.model.named_parameters())
        return {name: params[name].detach().to("cpu", tensor.dtype) for name, tensor in sent.items()}


# ----------------------------------------------------------------------------------------------------------
# HTTP


def make_http_server(core: RolloutServer, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """The five calls on (host, port) (port 0: any free one, `server.server_address` says which); one thread per
    request, so that /health and /qerl/info answer while a round holds the lock. Call serve_forever() to serve."""
    handler = type("Handler", (_Handler,), {"core": core})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True  # a round in flight never keeps the process from exiting
    return server


_ROUTES = {
    ("GET", "/health"): lambda core, body: {"ok": True},
    ("GET", "/qerl/info"): lambda core, body: core.info(),
    ("PUT", "/qerl/adapter"): lambda core, body: core.put_adapter(body),
    ("POST", "/qerl/adapter/version"): lambda core, body: core.relabel(**json.loads(body)),
    ("POST", "/qerl/generate"): lambda core, body: core.generate(RoundRequest.from_json(json.loads(body))).as_json(),
}


class _Handler(BaseHTTPRequestHandler):
    core: RolloutServer

    def do_GET(self):
        self._dispatch()

    do_PUT = do_POST = do_GET

    def _dispatch(self):
        route = _ROUTES.get((self.command, self.path))
        try:
            if route is None:
                raise Refused(404, f"no call {self.command} {self.path}")
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._reply(200, route(self.core, body))
        except Refused as err:
            self._reply(err.status, {"error": one_line(err), **err.fields})
        except Exception as err:  # the server stays up for the next call; the trainer gets the one line
            logger.exception("%s %s failed", self.command, self.path)
            self._reply(500, {"error": one_line(f"{type(err).__name__}: {err}")})

    def _reply(self, status: int, payload: dict[str, Any]):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 (BaseHTTPRequestHandler's name)
        logger.debug("%s %s", self.address_string(), format % args)


def serve(model: str, host: str, port: int, lora_rank: int, seed: int, engine: str, **settings) -> None:
    """Load `model` into `engine` on this process's GPU and serve it on (host, port) until the process is stopped:
    "native", the native engine (`settings`: kv_cache_gib), or "vllm", a VLLMEngine (`settings`: its keywords)."""
    if engine == "native":
        from qerl.rollout.native.server_engine import NativeServerEngine

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        built: ServerEngine = NativeServerEngine(model, device, seed, **settings)
    else:
        from qerl.rollout.vllm import VLLMEngine

        # The GPU is the server's alone: no sleep mode, nothing to give back between rounds.
        built = VLLMEngine(model, lora_rank=lora_rank, sleep=False, seed=seed, **settings)
    core = RolloutServer(built, model, lora_rank=lora_rank, seed=seed, name=f"{socket.gethostname()}:{port}")
    server = make_http_server(core, host, port)
    logger.info("rollout server: serving %s on http://%s:%d", model, host, port)
    server.serve_forever()
