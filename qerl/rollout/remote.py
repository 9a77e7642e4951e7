"""The trainer's side of rollouts on their own GPUs (issue 51): clients of the rollout servers (qerl/rollout/server.py),
the pool that keeps them in step with the policy, and the pipeline that samples the next round while a step trains.

Stdlib HTTP with a timeout on every call and every wait, so that a server that is down, slow or gone shows as one line
naming its address (and the round), never as a hang. Each failure has its class, all of them UsageErrors (a setup's
mistake, or a server to restart): qerl.cli prints them as one line.
"""

from __future__ import annotations

import http.client
import itertools
import json
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, TypeVar
from urllib.parse import urlsplit

from qerl.errors import UsageError, one_line
from qerl.rollout.wire import (
    PROTOCOL,
    AdapterSnapshot,
    NoiseSpec,
    RoundRequest,
    RoundResult,
    base_fingerprint,
    encode_adapter,
)

T = TypeVar("T")


class RolloutServerError(UsageError):
    """A rollout server's failure; the message is one line that names the server (and the fix, where known)."""


class ServerUnreachable(RolloutServerError):
    pass


class WrongBase(RolloutServerError):
    """The server cannot sample this policy: another base, protocol or too small a LoRA rank."""


class ServerDied(RolloutServerError):
    pass


class StaleAdapter(RolloutServerError):
    pass


class AdapterMismatch(RolloutServerError):
    """A digest the server reports is not the trainer's: of the adapter it holds, or of the round's noisy norms."""


# ----------------------------------------------------------------------------------------------------------
# One server


class ServerClient:
    """The calls to one server; a connection that fails, closes or stays silent past `timeout` raises ServerDied."""

    def __init__(self, url: str, timeout: float = 600.0):
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise UsageError(f"rollout server address {url!r}: give it as http://HOST:PORT")
        self.url, self.timeout = url.rstrip("/"), timeout

    def healthy(self, timeout: float) -> str | None:
        """None when the server answers /health within `timeout`, else why not."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout):
                return None
        except (OSError, http.client.HTTPException) as err:
            return _reason(err, timeout)

    def info(self) -> dict[str, Any]:
        return self.call("GET", "/qerl/info", during="the handshake")

    def put_adapter(self, snap: AdapterSnapshot, blob: bytes) -> dict[str, Any]:
        return self.call("PUT", "/qerl/adapter", blob, during=f"the sync of adapter v{snap.version}")

    def relabel(self, version: int, digest: str) -> dict[str, Any]:
        body = json.dumps({"version": version, "digest": digest}).encode()
        return self.call("POST", "/qerl/adapter/version", body, during=f"the sync of adapter v{version}")

    def generate(self, request: RoundRequest) -> RoundResult:
        body = json.dumps(request.as_json()).encode()
        return RoundResult.from_json(self.call("POST", "/qerl/generate", body, during=f"round {request.round}"))

    def call(self, method: str, path: str, body: bytes | None = None, *, during: str) -> dict[str, Any]:
        request = urllib.request.Request(self.url + path, data=body, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as err:  # the server answered: it says why
            raise self._refusal(err, during) from None
        except (OSError, http.client.HTTPException) as err:  # refused, reset, cut short, or silent past the timeout
            raise ServerDied(
                f"rollout server {self.url} died during {during} ({_reason(err, self.timeout)}); "
                "restart it and resume from the last checkpoint"
            ) from None

    def _refusal(self, err: urllib.error.HTTPError, during: str) -> RolloutServerError:
        try:
            message = json.loads(err.read())["error"]
        except (ValueError, KeyError, OSError):
            message = f"HTTP {err.code} {err.reason}"
        if err.code == 409:
            return StaleAdapter(one_line(f"rollout server {self.url} {message}"))
        return RolloutServerError(one_line(f"rollout server {self.url} failed {during}: {message}"))


def _reason(err: BaseException, timeout: float) -> str:
    cause = getattr(err, "reason", err)  # URLError wraps the socket's error; HTTPError's is the status's text
    if isinstance(cause, TimeoutError):
        return f"no reply within {timeout:g} s"
    return type(cause).__name__ if isinstance(cause, BaseException) else str(cause)


# ----------------------------------------------------------------------------------------------------------
# The servers of a run


class ServerPool:
    """The rollout servers of one run, all on the trainer's base: a round's prompts are cut into contiguous shards,
    one per server, and merged back in prompt order."""

    def __init__(self, urls: Sequence[str], model_path: str, *, lora_rank: int, timeout: float = 600.0):
        if not urls:
            raise UsageError("rollout servers: give at least one address")
        self.clients = [ServerClient(url, timeout) for url in urls]
        self.model_path, self.lora_rank = model_path, lora_rank
        self.fingerprint = base_fingerprint(model_path)
        self.held: dict[str, tuple[int, str] | None] = {}  # url -> (version, digest) its engine holds

    def handshake(self, timeout: float) -> None:
        """Wait up to `timeout` for every server to answer, then check that each can sample this policy."""
        deadline = time.monotonic() + timeout
        infos = _each(self.clients, lambda client: self._await(client, deadline, timeout))
        seeds: dict[int, str] = {}
        for client, info in zip(self.clients, infos, strict=True):
            self._check(client, info)
            # vLLM's seed is per engine (a seed per request would give every copy of a GRPO prompt one completion)
            if (other := seeds.setdefault(info["seed"], client.url)) != client.url:
                raise RolloutServerError(
                    f"rollout servers {other} and {client.url} both sample with seed {info['seed']}: "
                    "give each its own --seed, or they draw the same completions for the same prompts"
                )
            held = info["held"]
            self.held[client.url] = (held["version"], held["digest"]) if held else None

    def sync(self, snap: AdapterSnapshot) -> int:
        """Send `snap` to every server that does not hold it already (its version and digest): whole, or only its
        new version to a server that holds the same tensors under an older one. Returns how many were sent it whole."""
        behind = [c for c in self.clients if self.held.get(c.url) != (snap.version, snap.digest)]
        whole = [c for c in behind if (self.held.get(c.url) or (None, None))[1] != snap.digest]
        blob = encode_adapter(snap) if whole else None
        _each(behind, lambda client: self._send(client, snap, blob if client in whole else None))
        return len(whole)

    def generate(
        self,
        round_index: int,
        adapter_version: int,
        noise: NoiseSpec,
        sampling: dict[str, Any],
        prompt_ids: list[list[int]],
    ) -> RoundResult:
        if not prompt_ids:
            raise ValueError("a rollout round needs prompts")
        shards = [
            (client, RoundRequest(round_index, adapter_version, noise, sampling, prompt_ids[start:end]))
            for client, (start, end) in zip(self.clients, _shards(len(prompt_ids), len(self.clients)), strict=True)
            if end > start
        ]
        results = _each(shards, lambda shard: shard[0].generate(shard[1]))
        return _merge(round_index, results)

    def _await(self, client: ServerClient, deadline: float, timeout: float) -> dict[str, Any]:
        while (why := client.healthy(timeout=max(0.1, min(5.0, deadline - time.monotonic())))) is not None:
            if time.monotonic() >= deadline:
                port = urlsplit(client.url).port
                raise ServerUnreachable(
                    f"rollout server {client.url} unreachable after {timeout:g} s ({why}); start it with "
                    f"python -m qerl.rollout_server --model {self.model_path} --port {port}"
                )
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        return client.info()

    def _check(self, client: ServerClient, info: dict[str, Any]) -> None:
        base = info["base"]
        if info["protocol"] != PROTOCOL:
            raise WrongBase(
                f"rollout server {client.url} speaks protocol {info['protocol']}, the trainer {PROTOCOL}: "
                "run the same qerl on both"
            )
        if base["fingerprint"] != self.fingerprint:
            raise WrongBase(
                f"rollout server {client.url} serves {base['path']} (fingerprint {base['fingerprint'][:12]}), "
                f"the trainer's base is {self.model_path} ({self.fingerprint[:12]})"
            )
        if info["lora_rank"] < self.lora_rank:
            raise WrongBase(
                f"rollout server {client.url} takes LoRA rank up to {info['lora_rank']}, the policy's is "
                f"{self.lora_rank}: restart it with --lora-rank {self.lora_rank}"
            )

    def _send(self, client: ServerClient, snap: AdapterSnapshot, blob: bytes | None) -> None:
        """`snap` to `client`: the blob, or with None only its version (the server holds its tensors)."""
        self.held[client.url] = None  # until the server says what it holds now
        if blob is None:
            reply = client.relabel(snap.version, snap.digest)
        else:
            reply = client.put_adapter(snap, blob)
        if reply["digest"] != snap.digest:
            raise AdapterMismatch(
                f"rollout server {client.url} holds adapter v{reply['version']} digest {reply['digest'][:12]}, "
                f"the trainer sent {snap.digest[:12]}"
            )
        self.held[client.url] = (reply["version"], reply["digest"])


def _shards(count: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous (start, end) ranges over `count` items, sizes differing by at most one."""
    size, extra = divmod(count, parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def _merge(round_index: int, results: list[RoundResult]) -> RoundResult:
    """The shards' results as one, in prompt order; the servers must have drawn the same noise."""
    first = results[0]
    for other in results[1:]:
        if other.noise_digest != first.noise_digest:
            raise AdapterMismatch(
                f"rollout servers {first.server} and {other.server} sampled round {round_index} under different "
                f"noisy norms ({first.noise_digest[:12]} vs {other.noise_digest[:12]}): another checkpoint's "
                "norms, or another torch (see each server's /qerl/info)"
            )
    return RoundResult(
        [ids for r in results for ids in r.completion_ids],
        [lps for r in results for lps in r.logprobs],
        first.adapter_version,
        first.noise,
        first.noise_digest,
        ",".join(r.server for r in results),
    )


def _each(items: Sequence[T], call: Callable[[T], Any]) -> list[Any]:
    """call(item) for every item at once, on threads: the results in order, or the first error as soon as there is
    one (a server that died is reported without waiting for the others' rounds)."""
    if not items:
        return []
    threads = ThreadPoolExecutor(len(items), thread_name_prefix="qerl-rollout-server")
    try:
        futures = [threads.submit(call, item) for item in items]
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future.done() and future.exception() is not None:
                raise future.exception()
        return [future.result() for future in futures]
    finally:
        threads.shutdown(wait=False)  # the others end by their own timeouts


# ----------------------------------------------------------------------------------------------------------
# Sampling ahead


class RolloutPipeline:
    """Rounds sampled on the servers while the trainer trains. A round is named by its index (any int, unique among
    the rounds in flight) and trains the optimizer step of its noise (`noise.round[0]`): it is sampled with the newest
    adapter published once one of version >= that step - max_staleness is (version v: the policy after v optimizer
    steps), so with the default 1 the round of step k + 1 samples while step k trains. One worker thread: rounds run
    in the order submitted."""

    def __init__(self, pool: ServerPool, max_staleness: int = 1, wait_timeout: float = 1800.0):
        self.pool, self.max_staleness, self.wait_timeout = pool, max_staleness, wait_timeout
        self._state = threading.Condition()  # guards what follows; notified on every change
        self._newest: AdapterSnapshot | None = None
        self._results: dict[int, tuple[RoundResult | Exception, int]] = {}  # round -> (outcome, its step)
        self._unwanted: set[int] = set()  # rounds whose result nobody will ask for (discard)
        self._closed = False
        self._jobs: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="qerl-rollout-pipeline", daemon=True)
        self._worker.start()

    def publish(self, snap: AdapterSnapshot) -> None:
        """The policy's adapter after `snap.version` steps (taken between optimizer steps, wire.snapshot)."""
        with self._state:
            self._newest = snap
            self._state.notify_all()

    def submit(self, round_index: int, prompt_ids: list[list[int]], noise: NoiseSpec, sampling: dict[str, Any]) -> None:
        """Queue a round; returns at once."""
        self._jobs.put((round_index, prompt_ids, noise, sampling))

    def result(self, round_index: int, timeout: float) -> RoundResult:
        """The round's result, once sampled: the worker's error is raised here, and a round sampled with too old an
        adapter is refused (what the trainer consumes is checked here, whatever sampled it)."""
        with self._state:
            if not self._state.wait_for(lambda: round_index in self._results, timeout):
                raise RolloutServerError(f"round {round_index}: no result from the rollout servers after {timeout:g} s")
            outcome, step = self._results.pop(round_index)
        if isinstance(outcome, Exception):
            raise outcome
        if not self._fresh(step, outcome.adapter_version):
            raise StaleAdapter(
                f"round {round_index} (step {step}) was sampled with adapter v{outcome.adapter_version}, staleness "
                f"{step - outcome.adapter_version} > max {self.max_staleness}"
            )
        return outcome

    def discard(self, round_index: int) -> None:
        """Nobody will ask for this round's result: dropped when it comes (or now, if it has)."""
        with self._state:
            if self._results.pop(round_index, None) is None:
                self._unwanted.add(round_index)

    def close(self, timeout: float = 60.0) -> None:
        with self._state:
            self._closed = True
            self._state.notify_all()
        self._jobs.put(None)
        self._worker.join(timeout)

    def _fresh(self, step: int, version: int) -> bool:
        return step - version <= self.max_staleness

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            round_index, prompt_ids, noise, sampling = job
            try:
                outcome = self._round(round_index, prompt_ids, noise, sampling)
            except Exception as err:  # raised again on the trainer's thread, by result()
                outcome = err
            with self._state:
                if round_index in self._unwanted:
                    self._unwanted.discard(round_index)
                else:
                    self._results[round_index] = (outcome, noise.round[0])
                self._state.notify_all()

    def _round(self, round_index: int, prompt_ids, noise: NoiseSpec, sampling: dict[str, Any]) -> RoundResult:
        snap = self._adapter_for(round_index, noise.round[0])
        self.pool.sync(snap)
        return self.pool.generate(round_index, snap.version, noise, sampling, prompt_ids)

    def _adapter_for(self, round_index: int, step: int) -> AdapterSnapshot:
        """The newest adapter, once it is fresh enough for the round's step."""

        def fresh() -> bool:
            return self._newest is not None and self._fresh(step, self._newest.version)

        with self._state:
            self._state.wait_for(lambda: self._closed or fresh(), self.wait_timeout)
            if self._closed:
                raise RolloutServerError(f"round {round_index}: the rollout pipeline was closed before it was sampled")
            if not fresh():
                newest = "none" if self._newest is None else f"v{self._newest.version}"
                raise StaleAdapter(
                    f"round {round_index} (step {step}) needs adapter v{step - self.max_staleness} or newer (max "
                    f"staleness {self.max_staleness}); the newest published after {self.wait_timeout:g} s: {newest}"
                )
            return self._newest
