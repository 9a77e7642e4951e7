"""How QeRLTrainer samples a round: the rollout backend built from the run's settings, the policy opened for it, the
round's AQN noise, TRL's generation hook that samples it and, with rollout_max_staleness 1, the next round handed to
the rollout servers while this one trains. A mixin of QeRLTrainer (qerl/trainer.py), which holds the loss side.

The TRL internals this side relies on are in its own "THE TRL SEAM" section below, as the loss side's are in
qerl/trainer.py; tests/qerl/test_trainer_trl_seam.py pins both.
"""

from __future__ import annotations

import contextlib

import torch
from trl.extras.profiling import profiling_context

from qerl import aqn, rollout, rounds_ahead, sharding
from qerl.errors import UsageError


class RolloutRounds:
    """QeRLTrainer's rounds. Its state, made by `_init_rounds`: `rollout` (the backend), `rounds_ahead` (or None),
    `round_noise` (AQN's noise as a function of the round), `last_noise` (what the last round drew) and
    `_noise_round` (that round: optimizer step, round within it). It reads the trainer's `aqn_enabled`, and around
    each round hands memory between the rollout and the trainer's `dense_weights` and `kept_activations`."""

    def _init_rounds(self, args) -> None:
        self.rollout = rollout.create_backend(args.rollout_backend, self._rollout_setup())
        self.rounds_ahead = self._rounds_ahead() if args.rollout_max_staleness else None
        self.round_noise = aqn.RoundNoise(
            args.seed, args.aqn_final_norm, args.aqn_dtype, args.aqn_head_norms, required=self.aqn_enabled
        )
        self.last_noise = aqn.NoiseStats()
        self._noise_round = (-1, 0)  # (optimizer step, generation round within it) of the last round sampled

    def current_sigma(self, step: int | None = None) -> float:
        """AQN sigma for the current optimizer step, or `step` (0 when AQN is off or outside training)."""
        if not self.aqn_enabled or not self.model.training or not self.state.max_steps:
            return 0.0
        a = self.args
        step = self.state.global_step if step is None else step
        return aqn.sigma_at(step, self.state.max_steps, a.sigma_start, a.sigma_end, a.num_stages)

    def _next_round(self, sigma: float) -> aqn.NoisyRound:
        """The noise of the round about to be sampled. Rounds are counted by (optimizer step, round within the step):
        the same on every rank, so all ranks sample from one noisy policy as a single process would, and the same
        after a resume."""
        step = self.state.global_step
        self._noise_round = (step, self._noise_round[1] + 1 if self._noise_round[0] == step else 0)
        return aqn.NoisyRound(self.round_noise, sigma, self._noise_round, policy=self.model)

    def _sharding(self) -> str | None:
        """How the run shards the policy's parameters: "fsdp2", "zero3", or None (one process, DDP, ZeRO-1/2: whole
        on every rank). FSDP1 and ZeRO-3 without the gather for generation are refused by QeRLConfig."""
        if self.is_fsdp_enabled:
            return "fsdp2"
        plugin = self.args.deepspeed_plugin
        return "zero3" if plugin is not None and plugin.zero_stage == 3 else None

    def _rounds_ahead(self) -> rounds_ahead.RoundsAhead:
        """rollout_max_staleness 1: the set-ups where the next round is known while this one trains."""
        args = self.args
        generate_every = args.steps_per_generation * args.num_iterations
        if self.accelerator.num_processes > 1:
            raise UsageError("rollout_max_staleness 1 runs in one training process (the servers take its rounds)")
        if generate_every != args.gradient_accumulation_steps:
            raise UsageError(
                f"rollout_max_staleness 1 samples one round per optimizer step: steps_per_generation x num_iterations "
                f"({generate_every}) must equal gradient_accumulation_steps ({args.gradient_accumulation_steps})"
            )
        return rounds_ahead.RoundsAhead(generate_every)

    # ======================================================================================================
    # THE TRL SEAM, rollout side (trl 1.16): every TRL internal this side relies on is used below and nowhere above.
    #
    # Private methods, overridden or called:
    #   _generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False)
    #       -> (completion ids, sampled-token log-probs): TRL's one call that samples a round. Overridden: the
    #       round goes to our rollout backend, under AQN.
    #   _get_train_sampler(dataset) -> TRL's RepeatSampler: wrapped (rollout_max_staleness 1) to record an epoch's
    #       order, which yields each round's rows steps_per_generation x num_iterations times in a row.
    #   _tokenize_prompts(prompts) -> (prompt_ids, images, multimodal_fields): called on the next round's prompts
    #       (rollout_max_staleness 1), as _generate will call it on them when that round comes.
    # Private state:
    #   _metrics[mode][name]: the lists TRL averages and logs; aqn/* and rollout/staleness go there.
    #   _tokenizer, eos_token_ids, pad_to_multiple_of, generation_config: the rollout's settings, as TRL made them.
    # TRL's helpers: profiling_context, unwrap_model_for_generation.

    def _rollout_setup(self) -> rollout.RolloutSetup:
        args = self.args
        # A loaded model remembers its folder (transformers and our NVFP4 loader set it).
        model_path = getattr(self.accelerator.unwrap_model(self.model).config, "_name_or_path", None) or None
        return rollout.RolloutSetup(
            generation_config=self.generation_config,
            eos_token_ids=list(self.eos_token_ids),
            pad_token_id=self._tokenizer.pad_token_id,
            open_policy=self._open_policy,
            device=self.accelerator.device,
            model_path=model_path,
            pad_to_multiple_of=self.pad_to_multiple_of,
            sharding=self._sharding(),
            native=rollout.NativeSettings(
                args.rollout_kv_cache_gib,
                args.rollout_kv_cache_dtype,
                self.is_nvfp4 if args.rollout_compact_rows is None else args.rollout_compact_rows,
                args.rollout_keep_between_rounds,
            ),
            server=rollout.ServerSettings(
                tuple(args.rollout_servers), args.rollout_server_timeout, args.rollout_max_staleness
            ),
            vllm=rollout.VLLMSettings(
                gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                max_model_len=args.vllm_max_model_length,
                sleep=args.vllm_enable_sleep_mode,
                # The fp32 noise rule needs FP32 scales in the engine's norms, or small noise rounds away.
                fp32_norms=args.aqn_dtype == "fp32",
                seed=args.seed,
            ),
        )

    @contextlib.contextmanager
    def _open_policy(self):
        """The policy as one module to sample from: unwrapped from DDP, ZeRO-3 parameters gathered (TRL's
        unwrap), FSDP2 units resharded on the way in and out (sharding.reshard), so that AQN and the engines read
        and perturb the shards every forward all-gathers."""
        from trl.models import unwrap_model_for_generation

        with unwrap_model_for_generation(
            self.model_wrapped,
            self.accelerator,
            gather_deepspeed3_params=self.args.ds3_gather_for_generation,
            gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
        ) as model:
            sharding.reshard(model)
            try:
                yield model
            finally:
                sharding.reshard(model)

    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        return sampler if self.rounds_ahead is None else self.rounds_ahead.sampler(sampler)

    def _sample_next_round(self) -> None:
        """Hand the rollout servers the next round while this one trains: its rows in the epoch's order, its prompts
        tokenized as TRL will, its noise of the next step. At an epoch's end (the next order not drawn yet) and after
        the last step, nothing: that round is sampled when its step needs it."""
        rows = self.rounds_ahead.next_rows()
        step = self.state.global_step + 1
        if rows is None or step >= self.state.max_steps:
            return
        prompt_ids, _, _ = self._tokenize_prompts([self.train_dataset[i]["prompt"] for i in rows])
        noise = aqn.NoisyRound(self.round_noise, self.current_sigma(step), (step, 0), policy=self.model)
        self.rollout.sample_ahead(prompt_ids, noise)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None or multimodal_fields:
            raise NotImplementedError("QeRLTrainer trains text-only policies")
        mode = "train" if self.model.training else "eval"
        sigma = self.current_sigma()
        if self.accelerator.device.type == "cpu":
            # On the CPU an NVFP4 linear is codec.dequantize then F.linear (ops.nvfp4_linear), so sampling from the
            # copies gives the same numbers without decoding every weight at every token (10x faster on SmolLM2).
            self.dense_weights.materialize()
        else:
            self.dense_weights.release()  # the engine gets the memory; a policy-side rollout decodes per call
        # Compiled layers run eagerly in a rollout that calls them (the transformers backend): compiled, they would
        # compile again for every layer index and cache state; the training passes keep their graphs.
        eager = torch.compiler.set_stance("force_eager") if self.args.compile_layers else contextlib.nullcontext()
        with profiling_context(self, f"{self.rollout.name}.generate"), eager:
            output = self.rollout.generate(prompt_ids, self._next_round(sigma))
        with profiling_context(self, "dense_weights.materialize"):
            self.dense_weights.materialize()
        self.last_noise = output.noise  # the round's noise, for the metrics and the shift forward
        if mode == "train" and self.rounds_ahead is not None:
            self._sample_next_round()
        if mode == "train":
            # the largest micro-batch: its rows padded to the round's longest
            longest = max(len(p) + len(c) for p, c in zip(prompt_ids, output.completion_ids, strict=True))
            self.kept_activations.decide(self.args.per_device_train_batch_size * longest, self.accelerator.device)
            self._metrics[mode]["aqn/sigma"].append(sigma)
            self._metrics[mode]["aqn/changed_fraction"].append(self.last_noise.changed_fraction)
            if output.adapter_version is not None:  # optimizer steps between the adapter that sampled and this one
                self._metrics[mode]["rollout/staleness"].append(self.state.global_step - output.adapter_version)
        return output.completion_ids, output.logprobs
