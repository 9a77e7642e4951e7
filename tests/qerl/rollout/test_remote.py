"""Rollouts on their own GPUs (issue 51), on the CPU.

The wire (qerl/rollout/wire.py): the adapter blob keeps every tensor bit for bit and a snapshot is a copy, a digest
sees one bit, a round's JSON comes back equal, the base's fingerprint reads headers only.

The servers and the trainer's side (qerl/rollout/server.py, remote.py): two real HTTP servers on port 0, in threads,
each around a fake engine whose completions are a function of the LoRA and norms it holds when it samples, so that a
stale, wrong or noisy adapter shows in the tokens. What they are held to: the policy's own tensors, and RoundNoise
replayed on the policy (the trainer's own replay of a round)."""

import dataclasses
import json
import socket
import threading
import time

import pytest
import torch
from rollout_servers import EOS, fake_sample, serving, train_step, trained_policy

from qerl.aqn import NoiseStats, RoundNoise
from qerl.errors import UsageError
from qerl.rollout.remote import (
    AdapterMismatch,
    RolloutPipeline,
    RolloutServerError,
    ServerDied,
    ServerPool,
    ServerUnreachable,
    StaleAdapter,
    WrongBase,
)
from qerl.rollout.vllm import adapter_tensors, lora_settings
from qerl.rollout.wire import (
    SERVER_LORA_DTYPE,
    NoiseSpec,
    RoundRequest,
    RoundResult,
    base_fingerprint,
    decode_adapter,
    encode_adapter,
    norms_digest,
    snapshot,
    tensor_digest,
)
from qerl.tiny import build_tiny

SAMPLING = {"temperature": 1.0, "max_tokens": 8, "stop_token_ids": [EOS], "logprobs": 0}
PROMPTS = [[10 + i, 20, 30 + i] for i in range(5)]  # 5 prompts over 2 servers: shards of 3 and 2
NO_NOISE = NoiseSpec.of(RoundNoise(0, False, "fp32", False), 0.0, (0, 0))


def test_the_adapter_blob_keeps_every_tensor_and_setting():
    policy = trained_policy()
    snap = snapshot(policy, 7)
    back = decode_adapter(encode_adapter(snap))
    lora_ref, norms_ref = adapter_tensors(policy)  # the policy's own tensors
    assert back.version == 7 and back.settings == lora_settings(policy)
    # the LoRA as the server's engine holds it (its FP32 masters rounded once to BF16), the norms whole in FP32
    as_held = {name: tensor.to(SERVER_LORA_DTYPE) for name, tensor in lora_ref.items()}
    for got, ref in ((back.lora, as_held), (back.norms, norms_ref)):
        assert got.keys() == ref.keys()
        for name, tensor in ref.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert {t.dtype for t in lora_ref.values()} == {torch.float32} and {t.dtype for t in back.lora.values()} == {
        torch.bfloat16
    }
    assert any(name.startswith("model.layers.0.") for name in back.norms)  # vLLM's names, apart from peft's
    assert back.digest == snap.digest


def test_a_snapshot_is_a_copy_that_training_does_not_change():
    policy = trained_policy()
    snap = snapshot(policy, 0)
    kept = {name: tensor.clone() for name, tensor in {**snap.lora, **snap.norms}.items()}
    train_step(policy, 1)
    assert snapshot(policy, 1).digest != snap.digest  # the step moved the policy ...
    for name, tensor in {**snap.lora, **snap.norms}.items():
        assert torch.equal(tensor, kept[name]), name  # ... and not the snapshot taken before it


def test_a_digest_sees_one_bit_and_the_dtype():
    x = torch.linspace(0.5, 1.5, 16, dtype=torch.bfloat16)
    moved = x.clone()
    moved.view(torch.int16)[3] += 1  # one BF16 ulp on one entry
    assert tensor_digest({"w": x}) == tensor_digest({"w": x.clone()})
    assert tensor_digest({"w": x}) != tensor_digest({"w": moved})
    assert tensor_digest({"w": x}) != tensor_digest({"w": x.float()})  # equal values, another dtype
    assert tensor_digest({"w": x}) != tensor_digest({"v": x})
    assert tensor_digest({"w": x}) != tensor_digest({"w": x.reshape(4, 4)})


def test_a_round_travels_as_json():
    spec = NoiseSpec.of(RoundNoise(1234, True, "fp32", False), 1e-4, (3, 1))
    assert spec.round == (3, 1) and spec.seed == 1234 and spec.include_final and spec.dtype_rule == "fp32"
    request = RoundRequest(5, 4, spec, {"temperature": 0.7, "stop_token_ids": [2]}, [[1, 2, 3], [4]])
    assert RoundRequest.from_json(json.loads(json.dumps(request.as_json()))) == request
    result = RoundResult([[5, 2]], [[-0.1, -1 / 3]], 4, NoiseStats(1e-4, 4, 256, 0.98), "ab" * 16, "host:8001")
    assert RoundResult.from_json(json.loads(json.dumps(result.as_json()))) == result


def test_the_base_fingerprint_reads_config_and_headers(tmp_path):
    model, _ = build_tiny(dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")  # the same base, cut into several files
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert base_fingerprint(str(tmp_path / "one")) == base_fingerprint(str(tmp_path / "sharded"))
    build_tiny(dtype=torch.bfloat16, num_layers=1)[0].save_pretrained(tmp_path / "other")
    assert base_fingerprint(str(tmp_path / "other")) != base_fingerprint(str(tmp_path / "one"))
    config = json.loads((tmp_path / "one" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    (tmp_path / "sharded" / "config.json").write_text(json.dumps(config))
    assert base_fingerprint(str(tmp_path / "sharded")) != base_fingerprint(str(tmp_path / "one"))


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_a_folder_without_a_checkpoint_is_one_line(tmp_path, missing):
    build_tiny(dtype=torch.bfloat16)[0].save_pretrained(tmp_path)
    (tmp_path / missing).unlink()
    with pytest.raises(UsageError) as caught:
        base_fingerprint(str(tmp_path))
    assert str(tmp_path) in str(caught.value) and "\n" not in str(caught.value)
    assert ("config.json" if missing == "config.json" else "*.safetensors") in str(caught.value)


# ----------------------------------------------------------------------------------------------------------
# The servers


def expected(digest: str, prompts=PROMPTS) -> list[list[int]]:
    return [fake_sample(digest, prompt)[0][:6] for prompt in prompts]  # up to and including EOS


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """(the policy's base folder, another base's): the tiny Qwen2 of trained_policy, and one with a layer less."""
    root = tmp_path_factory.mktemp("bases")
    build_tiny(dtype=torch.bfloat16)[0].save_pretrained(root / "base")
    build_tiny(dtype=torch.bfloat16, num_layers=1)[0].save_pretrained(root / "other")
    return str(root / "base"), str(root / "other")


def pool_of(servers, base: str, timeout: float = 10.0, lora_rank: int = 4) -> ServerPool:
    pool = ServerPool([url for url, _, _ in servers], base, lora_rank=lora_rank, timeout=timeout)
    pool.handshake(timeout=5.0)
    return pool


def one_line_error(caught) -> str:
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_sync_puts_the_policys_adapter_on_every_server_bit_for_bit_and_only_once(bases, caplog):
    policy = trained_policy()
    caplog.set_level("INFO", logger="qerl.rollout.server")
    with serving(bases[0]) as servers:
        pool = pool_of(servers, bases[0])
        snap = snapshot(policy, 0)
        assert pool.sync(snap) == 2
        lora_ref, norms_ref = adapter_tensors(policy)  # the policy's own tensors, not the snapshot's
        lora_ref = {name: tensor.to(SERVER_LORA_DTYPE) for name, tensor in lora_ref.items()}  # as the engine holds it
        for _, _, fake in servers:
            assert fake.lora.keys() == lora_ref.keys()
            assert all(torch.equal(fake.lora[n], t) and fake.lora[n].dtype == t.dtype for n, t in lora_ref.items())
            held = dict(fake.model.named_parameters())  # read back from the engine's model
            assert all(held[n].dtype == torch.float32 and torch.equal(held[n], t) for n, t in norms_ref.items())
        megabytes = len(encode_adapter(snap)) / 1e6  # the adapter's bytes: what each server logs it received
        assert [r.getMessage() for r in caplog.records].count(f"adapter v0: {megabytes:.1f} MB received, "
                                                              f"digest {snap.digest[:12]}") == 2  # fmt: skip
        assert pool.sync(snap) == 0  # the same version and digest: nothing sent
        assert [fake.loads for _, _, fake in servers] == [1, 1]
        train_step(policy, 1)
        assert pool.sync(snapshot(policy, 1)) == 2
        again = pool_of(servers, bases[0])  # a new trainer (a resume) learns what each server holds from its info
        assert again.sync(snapshot(policy, 1)) == 0


def test_an_adapter_that_a_step_left_as_it_was_takes_only_its_new_version(bases, caplog):
    """A step that moved nothing (a learning rate of 0): the servers holding the same tensors get the new version's
    number, not the blob, and sample rounds of that version; a relabel to tensors a server does not hold is refused."""
    policy = trained_policy()
    caplog.set_level("INFO", logger="qerl.rollout.server")
    with serving(bases[0]) as servers:
        pool = pool_of(servers, bases[0])
        assert pool.sync(snapshot(policy, 0)) == 2
        same = snapshot(policy, 1)
        assert pool.sync(same) == 0 and [fake.loads for _, _, fake in servers] == [1, 1]  # no blob sent
        assert all(pool.held[url] == (1, same.digest) for url, _, _ in servers)
        assert [r.getMessage() for r in caplog.records].count(f"adapter v1: the one held, relabelled (digest "
                                                              f"{same.digest[:12]})") == 2  # fmt: skip
        assert pool.generate(1, 1, NO_NOISE, SAMPLING, PROMPTS).completion_ids == expected(same.digest)
        with pytest.raises(StaleAdapter, match="holds adapter digest .*, not 0123456789ab: send it whole"):
            pool.clients[0].relabel(2, "0123456789abcdef")


def test_a_round_is_cut_into_shards_and_merged_in_prompt_order(bases):
    snap = snapshot(trained_policy(), 0)
    with serving(bases[0]) as servers:
        pool = pool_of(servers, bases[0])
        pool.sync(snap)
        result = pool.generate(9, 0, NO_NOISE, SAMPLING, PROMPTS)
        assert [fake.prompts_seen for _, _, fake in servers] == [3, 2]
    assert result.completion_ids == expected(snap.digest)  # each prompt's own first token, in order; cut after EOS
    assert result.logprobs == [[-0.25 * (i + 1) for i in range(6)]] * len(PROMPTS)
    assert result.adapter_version == 0 and result.server == "fake1,fake2"
    assert result.noise.sigma == 0.0


def test_the_servers_draw_the_noise_the_trainer_replays(bases):
    policy = trained_policy()
    trainer_noise = RoundNoise(1234, include_final=True, dtype_rule="fp32", include_head_norms=False)
    sigma, noise_round = 1e-3, (3, 1)
    with serving(bases[0]) as servers:
        pool = pool_of(servers, bases[0])
        pool.sync(snapshot(policy, 3))
        result = pool.generate(3, 3, NoiseSpec.of(trainer_noise, sigma, noise_round), SAMPLING, PROMPTS)
        clean = pool.generate(3, 3, NO_NOISE, SAMPLING, PROMPTS)
        held = dict(servers[0][2].model.named_parameters())
    with trainer_noise.of_round(policy, sigma, noise_round) as stats:  # the trainer's replay, on the policy's norms
        replayed = norms_digest(policy, trainer_noise)
    assert result.noise_digest == replayed and result.noise == stats
    assert stats.num_norms == 5 and stats.changed_fraction > 0.9  # 2 layers x 2 norms, and the final one
    assert replayed != norms_digest(policy, trainer_noise)  # the noise moved them ...
    assert result.completion_ids != clean.completion_ids  # ... and the engine sampled under it
    assert clean.completion_ids == expected(snapshot(policy, 3).digest)  # the clean norms back after the round
    _, norms_ref = adapter_tensors(policy)
    assert all(torch.equal(held[name], tensor) for name, tensor in norms_ref.items())
    with trainer_noise.of_round(policy, sigma, (3, 2)):
        assert norms_digest(policy, trainer_noise) != result.noise_digest  # the next round draws other noise


def test_a_closed_port_is_unreachable_in_one_line(bases):
    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pool = ServerPool([f"http://127.0.0.1:{port}"], bases[0], lora_rank=4)
    start = time.monotonic()
    with pytest.raises(ServerUnreachable) as caught:
        pool.handshake(timeout=0.5)
    assert time.monotonic() - start < 3
    message = one_line_error(caught)
    assert f"http://127.0.0.1:{port} unreachable after 0.5 s (ConnectionRefusedError)" in message
    assert f"python -m qerl.rollout_server --model {bases[0]} --port {port}" in message


def test_a_server_that_cannot_sample_this_policy_is_refused_at_the_handshake(bases):
    base, other = bases
    with serving(other, seeds=(1,)) as servers:
        with pytest.raises(WrongBase) as caught:
            pool_of(servers, base)
        assert f"{servers[0][0]} serves {other}" in one_line_error(caught) and f"base is {base}" in str(caught.value)
    with serving(base, seeds=(1,)) as servers:
        with pytest.raises(
            WrongBase, match="takes LoRA rank up to 4, the policy's is 16: restart it with --lora-rank 16"
        ):
            pool_of(servers, base, lora_rank=16)
    with serving(base, seeds=(3, 3)) as servers:
        with pytest.raises(RolloutServerError, match="both sample with seed 3: give each its own --seed"):
            pool_of(servers, base)


def test_an_engine_that_rounds_the_norms_is_a_mismatch(bases):
    """FP32 norm masters in an engine whose scales are BF16 (vLLM without fp32_norms) would lose AQN's noise: the
    digest of the norms read back shows it."""
    with serving(bases[0], seeds=(1,), fp32_norms=False) as servers:
        pool = pool_of(servers, bases[0])
        snap = snapshot(trained_policy(), 2)
        with pytest.raises(AdapterMismatch) as caught:
            pool.sync(snap)
    assert f"{servers[0][0]} holds adapter v2 digest" in one_line_error(caught)
    assert f"the trainer sent {snap.digest[:12]}" in str(caught.value)


def test_an_engine_that_holds_the_lora_otherwise_than_sent_is_a_mismatch(bases):
    """The digest a server returns is of the LoRA its engine reads back (the native one's), so an engine that holds it
    in another dtype than the trainer's BF16 is caught at the sync, not in the rounds' log-probs."""
    with serving(bases[0], seeds=(1,), lora_dtype=torch.float16) as servers:
        pool = pool_of(servers, bases[0])
        assert pool.clients[0].info()["lora_digest_of"] == "held"
        snap = snapshot(trained_policy(), 3)
        with pytest.raises(AdapterMismatch) as caught:
            pool.sync(snap)
    assert f"{servers[0][0]} holds adapter v3 digest" in one_line_error(caught)


def test_a_round_for_another_adapter_version_is_refused(bases):
    with serving(bases[0]) as servers:
        pool = pool_of(servers, bases[0])
        pool.sync(snapshot(trained_policy(), 0))
        with pytest.raises(StaleAdapter) as caught:
            pool.generate(3, 1, NO_NOISE, SAMPLING, PROMPTS)  # asks for v1; the servers hold v0 (HTTP 409)
    assert "holds adapter v0, round 3 asked for v1" in one_line_error(caught)
    assert any(url in str(caught.value) for url, _, _ in servers)


def test_a_server_that_dies_or_stalls_during_a_round_is_named(bases):
    with serving(bases[0]) as servers:
        pool = pool_of(servers, bases[0], timeout=0.5)
        pool.sync(snapshot(trained_policy(), 0))
        (alive_url, _, alive), (url, http, fake) = servers
        connections = []
        accept = http.finish_request

        def keep(request, address):  # runs on the request's own thread
            connections.append(request)
            accept(request, address)

        def die():  # the process gone: no listening socket, the round's connection cut without a reply
            http.shutdown()
            http.server_close()
            connections[-1].shutdown(socket.SHUT_RDWR)

        http.finish_request, http.handle_error = keep, lambda request, address: None  # a dead process says nothing
        fake.during_round = die
        with pytest.raises(ServerDied) as caught:
            pool.generate(7, 0, NO_NOISE, SAMPLING, PROMPTS)
        assert f"rollout server {url} died during round 7 (" in one_line_error(caught)
        assert "restart it and resume from the last checkpoint" in str(caught.value)

        stalled = pool_of(servers[:1], bases[0], timeout=0.5)
        released = threading.Event()
        alive.during_round = lambda: released.wait(5)  # alive, but silent past the client's timeout
        try:
            with pytest.raises(ServerDied) as caught:
                stalled.generate(8, 0, NO_NOISE, SAMPLING, PROMPTS)
        finally:
            released.set()
        assert f"rollout server {alive_url} died during round 8 (no reply within 0.5 s)" in one_line_error(caught)


def of_step(step: int) -> NoiseSpec:
    """A round without noise that trains optimizer step `step`: what its staleness is counted against."""
    return dataclasses.replace(NO_NOISE, round=(step, 0))


def test_the_pipeline_samples_the_next_round_while_a_step_trains(bases):
    policy = trained_policy()
    with serving(bases[0]) as servers:
        pipeline = RolloutPipeline(pool_of(servers, bases[0]), max_staleness=1, wait_timeout=10)
        published = [snapshot(policy, 0)]
        pipeline.publish(published[0])
        pipeline.submit(0, PROMPTS, of_step(0), SAMPLING)
        assert pipeline.result(0, timeout=10).completion_ids == expected(published[0].digest)
        for step in range(3):
            pipeline.submit(step + 1, PROMPTS, of_step(step + 1), SAMPLING)  # returns at once: the round samples ...
            train_step(policy, step + 1)  # ... while step `step` trains
            sampled = pipeline.result(step + 1, timeout=10)  # before the step's adapter is published
            assert sampled.adapter_version == step
            assert sampled.completion_ids == expected(published[step].digest)  # the adapter of version `step`
            published.append(snapshot(policy, step + 1))
            pipeline.publish(published[-1])
        pipeline.close()
        assert [fake.loads for _, _, fake in servers] == [3, 3]  # v0, v1, v2: each sent once
    assert len({snap.digest for snap in published}) == 4  # every version samples differently


def test_the_pipeline_refuses_a_round_too_stale_and_reraises_the_workers_error(bases):
    with serving(bases[0]) as servers:
        pipeline = RolloutPipeline(pool_of(servers, bases[0], timeout=2), max_staleness=1, wait_timeout=0.3)
        pipeline.publish(snapshot(trained_policy(), 0))
        pipeline.submit(7, PROMPTS, of_step(2), SAMPLING)  # the round of step 2 needs v1 or newer; only v0 comes
        with pytest.raises(StaleAdapter) as caught:
            pipeline.result(7, timeout=10)
        message = one_line_error(caught)
        assert "round 7 (step 2) needs adapter v1 or newer (max staleness 1); the newest published after 0.3 s: v0" in (
            message
        )

        url, http, _ = servers[0]
        http.shutdown()
        http.server_close()
        pipeline.submit(1, PROMPTS, of_step(1), SAMPLING)
        with pytest.raises(ServerDied) as caught:
            pipeline.result(1, timeout=10)  # raised on this thread, from the worker's
        assert f"rollout server {url} died during the sync of adapter v0 (ConnectionRefusedError)" in str(caught.value)
        pipeline.close()
        assert not pipeline._worker.is_alive()
