"""π0 policy (model type ``openpi``) on transformers' native ``PI0ForConditionalGeneration``, made an RL policy the
way πRL does it (Flow-SDE).

π0: a PaliGemma VLM (SigLIP + Gemma) reads every camera image and the instruction; a Gemma action expert attends to
the VLM's KV cache and denoises an action chunk ``[num_action_chunks, max_action_dim]`` by flow matching, from
Gaussian noise at t = 1 to actions at t = 0 in ``num_denoise_steps`` Euler steps of the predicted velocity
``v = noise - action``. The robot state (the env's ``state`` entry, zero-padded to ``max_state_dim``) conditions the
expert. The first ``action_dim`` of the ``max_action_dim`` outputs are the env's action.

Log-prob (Flow-SDE): in each call one denoising step j (drawn per row) is made stochastic:
``x' ~ N(x + [v + sigma^2 / (2t) (x + (1 - t) v)] dt, sigma^2 |dt|)`` with ``sigma = noise_level sqrt(t / (1 - t))``
(``1 - t`` floored at one step, so the first step is finite); the other steps are deterministic Euler steps. The
Gaussian density of x' at step j is the log-prob (per action dimension, reduced to the configured granularity;
RLinf's π0 recipes use ``chunk_level``). Forward inputs: the prompt, x and x' of the stochastic step and j, so
``evaluate`` recomputes exactly that density with one expert pass. Deterministic acting (evaluation) runs the plain
ODE from the row's own noise sample (seeded per episode and step). A value head on the VLM's prefix (mean over its
valid tokens) is the critic; ``train_expert_only`` freezes the VLM.

Flow-Noise (``noise_method: flow_noise``, πRL after ReinFlow): every denoising step is stochastic,
``x' ~ N(x + v dt, s^2)`` with ``s`` per action element from a learned noise head on the expert's output features,
bounded to ``[noise_std_min, noise_std_max]``; the log-prob is the joint density of the whole chain (the sum over the
steps; the chain's start is the fixed N(0, I)). Forward inputs: the chain ``x_0 .. x_K``; ``evaluate`` runs the K
expert passes again. The noise head is trained with the policy by the RL loss and plays no part in evaluation.

π0.5 (``pi05: true``) on the same transformers classes, with π0.5's differences: the robot state is discretised into
256 bins over [-1, 1] and written into the prompt as text (``Task: ..., State: 12 200 ...;\nAction: ``) for the VLM
to read, instead of a state token for the expert; the denoising time conditions the expert through adaptive RMSNorm
(a time MLP gives each of the expert's norms a scale and shift, and each residual branch a gate; zero-initialised,
so a new model starts as a plain Gemma expert), instead of being mixed into the action tokens; the expert sees only
the action tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from rlfleet.policies.base import PolicyEval, PolicyMixin, PolicyOutput, reduce_log_probs
from rlfleet.policies.families import FAMILIES
from rlfleet.policies.models.openvla import ByteTokenizer, has_tokenizer_files, load_hf_tokenizer, save_tokenizer

# actor.model.openpi defaults: a tiny π0 that runs on CPU, written once, in the family's size YAML (openpi_sizes.yaml
# beside this module; its entry in rlfleet.policies.families names it)
TINY = FAMILIES["openpi"].defaults()
NOISE_METHODS = ("flow_sde", "flow_noise")
STATE_BINS = 256  # π0.5's discretised state


class AdaRMSNorm(nn.Module):
    """π0.5's adaptive RMSNorm around one of the expert's Gemma norms: ``norm(x) * (1 + scale) + shift``, and a gate
    ``1 + g`` for the residual branch that follows the norm; scale, shift and g come from the time conditioning
    (set on ``cond.value`` for the duration of one expert pass) through a zero-initialised linear layer."""

    def __init__(self, base: nn.Module, dim: int, cond: _Conditioning):
        super().__init__()
        self.base, self.cond = base, cond
        self.modulation = nn.Linear(dim, 3 * dim)
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)
        self.gate: torch.Tensor | None = None

    def forward(self, x):
        y = self.base(x)
        c = self.cond.value
        if c is None:
            raise RuntimeError("π0.5's expert ran without its time conditioning")
        scale, shift, gate = self.modulation(c).to(y.dtype)[:, None, :].chunk(3, dim=-1)
        self.gate = 1.0 + gate
        return y * (1.0 + scale) + shift


class _Conditioning:
    """The time conditioning of the current expert pass, shared by every AdaRMSNorm of one policy."""

    value: torch.Tensor | None = None


def _gate_output(module, _inputs, output):
    """Forward hook on an expert layer's attention / MLP: the residual branch times its norm's gate. (Hooks are plain
    functions that find their norm on the module, so a deep copy of the policy gates with its own norms.)"""
    gate = module.gate_norm.gate
    if isinstance(output, tuple):
        return (output[0] * gate, *output[1:])
    return output * gate


def _keep_input(module, inputs, _output):
    """Forward hook on the action projection: keeps the expert's output features for the noise head."""
    module.last_input = inputs[0]


def sizes_from_pi0_config(cfg) -> dict:
    """A transformers ``PI0Config`` -> the ``actor.model.openpi`` sizes it amounts to (the architecture keys)."""
    vision, text, expert = cfg.vlm_config.vision_config, cfg.vlm_config.text_config, cfg.dit_config
    return dict(
        image_size=vision.image_size,
        patch_size=vision.patch_size,
        vision_hidden_size=vision.hidden_size,
        vision_layers=vision.num_hidden_layers,
        vision_heads=vision.num_attention_heads,
        vision_intermediate_size=vision.intermediate_size,
        vlm_hidden_size=text.hidden_size,
        vlm_layers=text.num_hidden_layers,
        vlm_heads=text.num_attention_heads,
        vlm_intermediate_size=text.intermediate_size,
        expert_hidden_size=expert.hidden_size,
        expert_layers=expert.num_hidden_layers,
        expert_intermediate_size=expert.intermediate_size,
        head_dim=text.head_dim,
        vocab_size=text.vocab_size,
        max_state_dim=cfg.max_state_dim,
        max_action_dim=cfg.max_action_dim,
    )


class Pi0Policy(PolicyMixin, nn.Module):
    def __init__(
        self,
        obs_specs: Mapping,
        action_dim: int,
        *,
        sizes: Mapping | None = None,
        num_action_chunks: int = 5,
        max_prompt_tokens: int = 48,
        add_value_head: bool = True,
        logprob_type: str = "chunk_level",
        pretrained=None,
        tokenizer=None,
    ):
        """``pretrained``: a loaded ``PI0ForConditionalGeneration`` (a transformers π0 checkpoint) whose config fixes
        the architecture; otherwise one is built from ``sizes``. ``tokenizer``: the checkpoint's (PaliGemma's);
        otherwise rlfleet's byte tokenizer (tiny models)."""
        super().__init__()
        from transformers import GemmaConfig, PaliGemmaConfig, PI0Config, PI0ForConditionalGeneration

        if pretrained is not None:
            sizes = {**dict(sizes or {}), **sizes_from_pi0_config(pretrained.config)}
        s = self.sizes = {**TINY, **dict(sizes or {})}
        self.obs_specs, self.action_dim = dict(obs_specs), int(action_dim)
        self.num_action_chunks, self.logprob_type = int(num_action_chunks), logprob_type
        self.image_keys = sorted(k for k, v in obs_specs.items() if v.is_image)
        if not self.image_keys:
            raise ValueError(f"model_type 'openpi' needs image observations; the env provides {sorted(obs_specs)}")
        self.state_keys = sorted(k for k, v in obs_specs.items() if not v.is_image)
        state_dim = sum(math.prod(obs_specs[k].shape) for k in self.state_keys)
        if state_dim > s["max_state_dim"] or action_dim > s["max_action_dim"]:
            raise ValueError(
                f"actor.model.openpi: state ({state_dim}) / action ({action_dim}) dims exceed "
                f"max_state_dim {s['max_state_dim']} / max_action_dim {s['max_action_dim']}"
            )
        self.num_steps = int(s["num_denoise_steps"])
        self.noise_level = float(s["noise_level"])
        if self.num_steps < 1 or self.noise_level <= 0:
            raise ValueError("actor.model.openpi: num_denoise_steps must be >= 1 and noise_level > 0")
        self.noise_method, self.pi05 = str(s["noise_method"]), bool(s["pi05"])
        if self.noise_method not in NOISE_METHODS:
            raise ValueError(
                f"actor.model.openpi.noise_method: '{self.noise_method}' is not one of {', '.join(NOISE_METHODS)}"
            )
        self.std_min, self.std_max = float(s["noise_std_min"]), float(s["noise_std_max"])
        if not 0 < self.std_min <= self.std_max:
            raise ValueError(
                f"actor.model.openpi: need 0 < noise_std_min <= noise_std_max, got {self.std_min}, {self.std_max}"
            )
        self.state_dim = state_dim
        self.tokenizer = tokenizer or ByteTokenizer()
        self.max_prompt_tokens = int(max_prompt_tokens)
        if self.pi05 and self.max_prompt_tokens < self._state_text_tokens() + 8:
            raise ValueError(
                f"actor.model.max_prompt_tokens: {self.max_prompt_tokens} cannot hold π0.5's prompt with "
                f"a {state_dim}-D state as text ({self._state_text_tokens()} tokens before the "
                f"instruction): raise it to at least {self._state_text_tokens() + 32}"
            )
        self.tokens_per_image = (int(s["image_size"]) // int(s["patch_size"])) ** 2
        vision = dict(
            image_size=s["image_size"],
            patch_size=s["patch_size"],
            hidden_size=s["vision_hidden_size"],
            num_hidden_layers=s["vision_layers"],
            num_attention_heads=s["vision_heads"],
            intermediate_size=s["vision_intermediate_size"],
        )
        text = dict(
            vocab_size=s["vocab_size"],
            hidden_size=s["vlm_hidden_size"],
            intermediate_size=s["vlm_intermediate_size"],
            num_hidden_layers=s["vlm_layers"],
            num_attention_heads=s["vlm_heads"],
            num_key_value_heads=1,
            head_dim=s["head_dim"],
        )
        expert = GemmaConfig(
            vocab_size=8,
            hidden_size=s["expert_hidden_size"],
            intermediate_size=s["expert_intermediate_size"],
            num_hidden_layers=s["expert_layers"],
            num_attention_heads=s["vlm_heads"],
            num_key_value_heads=1,
            head_dim=s["head_dim"],
        )
        if s["expert_layers"] != s["vlm_layers"]:
            raise ValueError(
                "actor.model.openpi: the action expert attends layer by layer to the VLM's cache: "
                "expert_layers must equal vlm_layers"
            )
        if pretrained is None:
            cfg = PI0Config(
                vlm_config=PaliGemmaConfig(
                    vision_config=vision,
                    text_config=text,
                    image_token_id=int(s["vocab_size"]) - 1,
                    projection_dim=s["vlm_hidden_size"],
                ),
                dit_config=expert,
                chunk_size=self.num_action_chunks,
                max_state_dim=s["max_state_dim"],
                max_action_dim=s["max_action_dim"],
                num_inference_steps=self.num_steps,
            )
            pretrained = PI0ForConditionalGeneration(cfg)
        elif pretrained.config.chunk_size != self.num_action_chunks:
            raise ValueError(
                f"actor.model.num_action_chunks: {self.num_action_chunks}, but the π0 checkpoint "
                f"predicts chunks of {pretrained.config.chunk_size}; set it to "
                f"{pretrained.config.chunk_size}"
            )
        self.pi0 = pretrained
        self.image_token_id = int(self.pi0.config.vlm_config.image_token_id)
        # the expert reads embeddings, never token ids; transformers sizes its token table like the VLM's (263M
        # parameters at π0's size): frozen, so it has no gradient, optimizer state or weight-update traffic
        self.pi0.model.dit.embed_tokens.requires_grad_(False)
        h = int(s["expert_hidden_size"])
        if self.pi05:
            embed = self.pi0.embed_action_time
            del embed.state_proj, embed.action_time_mlp_in, embed.action_time_mlp_out  # π0's state token and mixing
            self.time_mlp = nn.Sequential(nn.Linear(h, h), nn.SiLU(), nn.Linear(h, h), nn.SiLU())
            self._cond = _Conditioning()
            expert = self.pi0.model.dit
            for layer in expert.layers:
                layer.input_layernorm = AdaRMSNorm(layer.input_layernorm, h, self._cond)
                layer.post_attention_layernorm = AdaRMSNorm(layer.post_attention_layernorm, h, self._cond)
                for branch, norm in (
                    (layer.self_attn, layer.input_layernorm),
                    (layer.mlp, layer.post_attention_layernorm),
                ):
                    object.__setattr__(branch, "gate_norm", norm)  # a reference, not a submodule
                    branch.register_forward_hook(_gate_output)
            expert.norm = AdaRMSNorm(expert.norm, h, self._cond)
        self.pi0.action_out_proj.last_input = None  # the expert's output features of the last pass (noise head)
        self.pi0.action_out_proj.register_forward_hook(_keep_input)
        self.noise_head = (
            nn.Sequential(nn.Linear(h, h), nn.GELU(), nn.Linear(h, int(s["max_action_dim"])))
            if self.noise_method == "flow_noise"
            else None
        )
        self.has_critic = bool(add_value_head)
        self.value_head = (
            nn.Sequential(
                nn.Linear(s["vlm_hidden_size"], s["value_hidden_size"]), nn.GELU(), nn.Linear(s["value_hidden_size"], 1)
            )
            if add_value_head
            else None
        )
        if s["train_expert_only"]:
            for p in self.pi0.model.vlm.parameters():
                p.requires_grad_(False)

    # --- inputs ---------------------------------------------------------------------------------------------
    def _state_text_tokens(self) -> int:
        """Prompt tokens π0.5's prompt needs besides the instruction (BOS, the framing and up to 4 per state dim)."""
        return 1 + len(self.tokenizer.encode("Task: , State: ;\nAction: ")) + 4 * self.state_dim

    def _flat_state(self, obs: Mapping[str, torch.Tensor], n: int) -> torch.Tensor | None:
        if not self.state_keys:
            return None
        return torch.cat([obs[k].reshape(n, -1).to(self._dtype) for k in self.state_keys], 1)

    def tokenize(
        self, instructions: Sequence[str] | None, n: int, device, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Instructions (π0.5: and the state as text) -> right-padded ids [n, P] and mask [n, P] (image tokens are
        added in _prefix)."""
        P = self.max_prompt_tokens
        ids = torch.zeros((n, P), dtype=torch.long)
        mask = torch.zeros((n, P), dtype=torch.long)
        texts = list(instructions) if instructions else [""] * n
        if self.pi05 and state is not None:
            bins = ((state.clamp(-1.0, 1.0) + 1.0) * (STATE_BINS / 2)).long().clamp_(max=STATE_BINS - 1).cpu()
        for i, text in enumerate(texts):
            text = (text or "").strip().lower()
            if self.pi05:  # the instruction is cut, never the state
                state_text = " ".join(str(int(b)) for b in bins[i]) if state is not None else ""
                head = self.tokenizer.encode("Task: ")
                tail = self.tokenizer.encode(f", State: {state_text};\nAction: ")
                task = self.tokenizer.encode(text)[: P - 1 - len(head) - len(tail)]
                toks = [self.tokenizer.bos_token_id, *head, *task, *tail]
            else:
                toks = [self.tokenizer.bos_token_id, *self.tokenizer.encode(text + "\n")][:P]
            ids[i, : len(toks)] = torch.tensor(toks)
            mask[i, : len(toks)] = 1
        return ids.to(device), mask.to(device)

    def _inputs(self, obs: Mapping[str, torch.Tensor], prompt_ids, prompt_mask):
        n = prompt_ids.shape[0]
        size = int(self.sizes["image_size"])
        cams = []
        for k in self.image_keys:
            x = obs[k].permute(0, 3, 1, 2).to(self._dtype) / 255.0
            if x.shape[-1] != size or x.shape[-2] != size:
                x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
            cams.append(x * 2.0 - 1.0)  # SigLIP's [-1, 1]
        pixel_values = torch.stack(cams, 1)
        n_img = len(cams) * self.tokens_per_image
        ids = torch.cat(
            [torch.full((n, n_img), self.image_token_id, dtype=torch.long, device=prompt_ids.device), prompt_ids], 1
        )
        mask = torch.cat([torch.ones((n, n_img), dtype=torch.long, device=prompt_ids.device), prompt_mask], 1)
        state = torch.zeros((n, int(self.sizes["max_state_dim"])), device=prompt_ids.device, dtype=self._dtype)
        flat = self._flat_state(obs, n)
        if flat is not None:
            state[:, : flat.shape[1]] = flat
        return ids, mask, pixel_values, torch.ones((n, len(cams)), dtype=torch.bool, device=ids.device), state

    def _prefix(self, ids, mask, pixel_values, pixel_mask):
        """The VLM over [images][prompt]: its KV cache (for the expert) and the value-head features."""
        model = self.pi0.model
        out = model.vlm(
            inputs_embeds=model.embed_prefix(ids, pixel_values, pixel_mask),
            attention_mask=mask,
            position_ids=mask.cumsum(-1) - 1,
            token_type_ids=torch.zeros_like(mask),
            use_cache=True,
        )
        m = mask[..., None].to(out.last_hidden_state.dtype)
        pooled = (out.last_hidden_state * m).sum(1) / m.sum(1).clamp(min=1.0)
        return out.past_key_values, pooled

    def _velocity(self, state, x, t, mask, pixel_mask, cache):
        """The expert's velocity [n, chunk, max_action_dim] at (x, t) over the prefix cache. Its output features
        (the action projection's input) are left in ``self._features`` for the noise head."""
        prefix_len = cache.get_seq_length()
        if self.pi05:
            v = self._velocity_pi05(x, t, mask, cache, prefix_len)
        else:
            v = self.pi0(
                state=state,
                noise=x,
                timestep=t,
                attention_mask=mask,
                pixel_attention_mask=pixel_mask,
                past_key_values=cache,
            ).logits
        cache.crop(prefix_len - cache.get_seq_length())  # the expert's tokens never stay in the prefix cache
        return v

    def _velocity_pi05(self, x, t, mask, cache, prefix_len):
        """π0.5's expert pass: the action tokens alone (no state token), attending to the whole prefix and to each
        other, with the time in every norm (AdaRMSNorm)."""
        from transformers.masking_utils import create_causal_mask

        embed = self.pi0.embed_action_time
        tokens = embed.action_in_proj(x)
        n, chunk = tokens.shape[:2]
        full = torch.cat([mask, mask.new_ones((n, chunk))], 1)
        blocks = torch.cat(
            [
                torch.zeros(prefix_len, dtype=torch.long, device=x.device),
                torch.ones(chunk, dtype=torch.long, device=x.device),
            ]
        )[None].expand(n, -1)
        attn = create_causal_mask(
            config=self.pi0.config.dit_config,
            inputs_embeds=tokens,
            attention_mask=full,
            past_key_values=cache,
            block_sequence_ids=blocks,
        )
        self._cond.value = self.time_mlp(embed.sinusoid_embeds(t).to(tokens.dtype))
        try:
            out = self.pi0.model.dit(
                inputs_embeds=tokens,
                attention_mask=attn,
                position_ids=(full.cumsum(1) - 1)[:, -chunk:],
                past_key_values=cache,
            )
        finally:
            self._cond.value = None
        return self.pi0.action_out_proj(out.last_hidden_state[:, -chunk:])

    @property
    def _dtype(self) -> torch.dtype:
        """The parameters' dtype (fp32; fp64 in the learner's exactness tests): inputs are cast to it."""
        return self.pi0.action_out_proj.weight.dtype

    @property
    def _features(self) -> torch.Tensor:
        return self.pi0.action_out_proj.last_input

    def _noise_std(self) -> torch.Tensor:
        """Flow-Noise: the std of each action element's step, from the last expert pass's features."""
        raw = self.noise_head(self._features.to(self._dtype))
        return self.std_min + (self.std_max - self.std_min) * torch.sigmoid(raw)

    def _step_gaussian(self, x, v, t):
        """Flow-SDE step from time t (per row) by dt = -1/K: mean and std of x'."""
        dt = -1.0 / self.num_steps
        t_ = t[:, None, None]
        one_minus = (1.0 - t_).clamp(min=1.0 / self.num_steps)
        sigma = self.noise_level * torch.sqrt(t_ / one_minus)
        mean = x + (v + sigma**2 / (2.0 * t_.clamp(min=1e-6)) * (x + (1.0 - t_) * v)) * dt
        return mean, sigma * math.sqrt(-dt)

    def _log_prob(self, x_next, mean, std):
        """Gaussian log density per action element [n, chunk, action_dim] (the padded dims do not count)."""
        a = slice(0, self.action_dim)
        std = std.expand_as(mean)[..., a]
        z = (x_next[..., a] - mean[..., a]) / std
        return -0.5 * z**2 - torch.log(std) - 0.5 * math.log(2 * math.pi)

    def _value(self, pooled):
        return None if self.value_head is None else self.value_head(pooled.to(self._dtype)).squeeze(-1)

    # --- the policy interface -------------------------------------------------------------------------------
    @torch.no_grad()
    def act(
        self,
        obs: Mapping[str, torch.Tensor],
        deterministic: bool = False,
        instructions: Sequence[str] | None = None,
        noise=None,
    ) -> PolicyOutput:
        any_key = self.image_keys[0]
        n, device = obs[any_key].shape[0], obs[any_key].device
        prompt_ids, prompt_mask = self.tokenize(instructions, n, device, self._flat_state(obs, n))
        ids, mask, pixels, pixel_mask, state = self._inputs(obs, prompt_ids, prompt_mask)
        cache, pooled = self._prefix(ids, mask, pixels, pixel_mask)
        shape = (n, self.num_action_chunks, int(self.sizes["max_action_dim"]))
        prompt = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask.to(torch.uint8)}
        if self.noise_method == "flow_noise":
            return self._act_flow_noise(shape, state, mask, pixel_mask, cache, pooled, deterministic, noise, prompt)
        x = self._start_noise(shape, deterministic, noise, device)
        if deterministic:
            j = torch.zeros(n, dtype=torch.long, device=device)
        elif noise is not None:  # per-row streams (rlfleet.wire.codec): the chain's start, its noisy step, its noise
            j = (noise.torch_uniform((), x) * self.num_steps).long().clamp_(max=self.num_steps - 1)
        else:
            j = torch.randint(0, self.num_steps, (n,), device=device)
        x_j, x_next = x.clone(), x.clone()
        lp_mean, lp_std = torch.zeros_like(x), torch.ones_like(x)
        for k in range(self.num_steps):
            t = torch.full((n,), 1.0 - k / self.num_steps, device=device)
            v = self._velocity(state, x, t, mask, pixel_mask, cache)
            mean, std = self._step_gaussian(x, v, t)
            ode = x + v * (-1.0 / self.num_steps)
            here = (j == k)[:, None, None]
            if deterministic:
                new = ode
            else:
                eps = torch.randn_like(mean) if noise is None else noise.torch_normal(mean.shape[1:], mean)
                new = torch.where(here, mean + std * eps, ode)
            x_j = torch.where(here, x, x_j)
            x_next = torch.where(here, new, x_next)
            lp_mean = torch.where(here, mean, lp_mean)
            lp_std = torch.where(here, std.expand_as(mean), lp_std)
            x = new
        per_dim = self._log_prob(x_next, lp_mean, lp_std)
        actions = x[..., : self.action_dim]
        return PolicyOutput(
            actions,
            reduce_log_probs(per_dim, self.logprob_type),
            self._value(pooled),
            {**prompt, "x_t": x_j, "x_next": x_next, "denoise_step": j},
        )

    @staticmethod
    def _start_noise(shape, deterministic: bool, noise, device) -> torch.Tensor:
        """The chain's start x_0 ~ N(0, I): from each row's noise stream when given (rollouts and evaluations send
        keys seeded per env and step); without streams, deterministic acting starts every row from one fixed sample
        (one observation, one action; the all-zeros mean would be far from any sample the flow was trained on)."""
        if noise is not None:
            return noise.torch_normal(shape[1:], torch.empty(0, device=device))
        if deterministic:
            fixed = torch.randn(shape[1:], generator=torch.Generator().manual_seed(0))
            return fixed.to(device).expand(shape).clone()
        return torch.randn(shape, device=device)

    def _act_flow_noise(self, shape, state, mask, pixel_mask, cache, pooled, deterministic, noise, prompt):
        """Flow-Noise acting: K Gaussian steps around the Euler steps, std from the noise head; deterministic: the
        plain ODE from the same start (``_start_noise``)."""
        n, device = shape[0], mask.device
        x = self._start_noise(shape, deterministic, noise, device)
        chain, per_dim = [x], torch.zeros((n, shape[1], self.action_dim), device=device)
        for k in range(self.num_steps):
            t = torch.full((n,), 1.0 - k / self.num_steps, device=device)
            mean = x - self._velocity(state, x, t, mask, pixel_mask, cache) / self.num_steps
            if deterministic:
                x = mean
            else:
                std = self._noise_std()
                eps = torch.randn_like(mean) if noise is None else noise.torch_normal(mean.shape[1:], mean)
                x = mean + std * eps
                per_dim = per_dim + self._log_prob(x, mean, std)
            chain.append(x)
        return PolicyOutput(
            x[..., : self.action_dim],
            reduce_log_probs(per_dim, self.logprob_type),
            self._value(pooled),
            {**prompt, "chain": torch.stack(chain, 1)},
        )

    def _evaluate_flow_noise(self, state, mask, pixel_mask, cache, chain):
        """The chain's joint log density per action element and the entropy of its K Gaussian steps."""
        n = chain.shape[0]
        per_dim, entropy = 0.0, torch.zeros(n, device=chain.device)
        for k in range(self.num_steps):
            t = torch.full((n,), 1.0 - k / self.num_steps, device=chain.device)
            x = chain[:, k]
            mean = x - self._velocity(state, x, t, mask, pixel_mask, cache) / self.num_steps
            std = self._noise_std()
            per_dim = per_dim + self._log_prob(chain[:, k + 1], mean, std)
            entropy = entropy + (0.5 + 0.5 * math.log(2 * math.pi) + torch.log(std[..., : self.action_dim])).flatten(
                1
            ).sum(1)
        return per_dim, entropy

    def evaluate(
        self,
        obs: Mapping[str, torch.Tensor],
        forward_inputs: Mapping[str, torch.Tensor],
        instructions: Sequence[str] | None = None,
    ) -> PolicyEval:
        ids, mask, pixels, pixel_mask, state = self._inputs(
            obs, forward_inputs["prompt_ids"].long(), forward_inputs["prompt_mask"].long()
        )
        cache, pooled = self._prefix(ids, mask, pixels, pixel_mask)
        if self.noise_method == "flow_noise":
            per_dim, entropy = self._evaluate_flow_noise(
                state, mask, pixel_mask, cache, forward_inputs["chain"].to(self._dtype)
            )
            return PolicyEval(reduce_log_probs(per_dim, self.logprob_type), entropy, self._value(pooled))
        x_j, x_next = forward_inputs["x_t"].to(self._dtype), forward_inputs["x_next"].to(self._dtype)
        t = 1.0 - forward_inputs["denoise_step"].to(self._dtype) / self.num_steps
        v = self._velocity(state, x_j, t, mask, pixel_mask, cache)
        mean, std = self._step_gaussian(x_j, v, t)
        per_dim = self._log_prob(x_next, mean, std)
        std = std.expand_as(mean)[..., : self.action_dim]
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + torch.log(std)).flatten(1).sum(1)
        return PolicyEval(reduce_log_probs(per_dim, self.logprob_type), entropy, self._value(pooled))

    def bc_loss(
        self, obs: Mapping[str, torch.Tensor], actions: torch.Tensor, instructions: Sequence[str] | None = None
    ) -> torch.Tensor:
        """π0's flow-matching loss on demonstrated chunks [n, chunk, action_dim]: at a time t ~ Beta(1.5, 1)
        (π0's schedule, weighted to the noisy end) the expert's velocity at x_t = t noise + (1 - t) a must be
        noise - a."""
        n, device = actions.shape[0], actions.device
        prompt_ids, prompt_mask = self.tokenize(instructions, n, device, self._flat_state(obs, n))
        ids, mask, pixels, pixel_mask, state = self._inputs(obs, prompt_ids, prompt_mask)
        cache, _ = self._prefix(ids, mask, pixels, pixel_mask)
        target = torch.zeros((n, self.num_action_chunks, int(self.sizes["max_action_dim"])), device=device)
        target[..., : self.action_dim] = actions.float().view(n, self.num_action_chunks, self.action_dim)
        noise = torch.randn_like(target)
        t = torch.distributions.Beta(1.5, 1.0).sample((n,)).to(device) * 0.999 + 0.001
        x_t = t[:, None, None] * noise + (1.0 - t[:, None, None]) * target
        v = self._velocity(state, x_t, t, mask, pixel_mask, cache)
        a = slice(0, self.action_dim)
        return F.mse_loss(v[..., a].float(), (noise - target)[..., a])

    def save_pretrained(self, path) -> None:
        """config.json (model type and sizes) + model.safetensors, the layout actor.model.model_path loads."""
        import json
        from pathlib import Path

        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.detach().contiguous().clone() for k, v in self.state_dict().items()}, str(path / "model.safetensors")
        )
        (path / "config.json").write_text(
            json.dumps(
                {"model_type": "openpi", "openpi": self.sizes, "num_action_chunks": self.num_action_chunks}, indent=2
            )
        )
        save_tokenizer(self.tokenizer, path)

    def save_upstream(self, path, step: int | None = None, max_shard_size: int | str = "5GB"):
        """Write π0 in transformers' π0 layout, the one ``lerobot/pi0_base`` is loaded from here: transformers' own
        ``save_pretrained`` of the ``PI0ForConditionalGeneration`` (config.json with model_type pi0, safetensors
        sharded by ``max_shard_size`` in lerobot's key names: transformers reverts the same conversion mapping its
        loader applies), and the tokenizer's files beside it (the byte tokenizer of tiny models as real files). The
        value head and Flow-Noise's noise head (RL-side modules, no part of π0) are not written: a load starts
        them fresh. π0.5 has no transformers class, so no such layout."""
        from pathlib import Path

        from rlfleet.policies.models.openvla.tokenizers import save_tokenizer_files

        if self.pi05:
            raise ValueError(
                "π0.5 (actor.model.openpi.pi05) has no upstream layout transformers loads (transformers "
                "has no π0.5 class): export it with --layout rlfleet"
            )
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.pi0.save_pretrained(str(path), max_shard_size=max_shard_size)
        save_tokenizer_files(self.tokenizer, path)
        return path

    @classmethod
    def from_config(
        cls, model_cfg, obs_specs: Mapping, action_dim: int, normalize_obs: bool, logprob_type: str = "chunk_level"
    ) -> Pi0Policy:
        """Build from ``actor.model``: from the ``openpi`` sizes, or from ``model_path``, a checkpoint directory in
        rlfleet's layout (``config.json`` with model_type ``openpi``, ``model.safetensors``, optional ``tokenizer/``)
        or in transformers' π0 layout (``config.json`` with model_type ``pi0``, safetensors, possibly sharded, and
        PaliGemma's tokenizer files, as ``lerobot/pi0_base``)."""
        sizes = dict(model_cfg.openpi)
        # the architecture comes from a checkpoint; the RL-side knobs always from the config
        keep = (
            "noise_level",
            "train_expert_only",
            "num_denoise_steps",
            "value_hidden_size",
            "noise_method",
            "noise_std_min",
            "noise_std_max",
        )
        kwargs = dict(
            num_action_chunks=model_cfg.num_action_chunks,
            max_prompt_tokens=model_cfg.max_prompt_tokens,
            add_value_head=model_cfg.add_value_head,
            logprob_type=logprob_type,
        )
        if not model_cfg.model_path:
            return cls(obs_specs, action_dim, sizes=sizes, **kwargs)
        from pathlib import Path

        from rlfleet.policies.hub import resolve_model_path
        from rlfleet.policies.model_folder import (
            check_build_fits,
            check_sizes,
            elements,
            has_file,
            load_tensors,
            read_config,
            tensor_headers,
        )
        from rlfleet.untrusted import BadFile

        path = Path(resolve_model_path(model_cfg.model_path))  # a folder, or a hub id's snapshot in the hub cache
        if not has_file(path, "config.json"):
            raise FileNotFoundError(
                f"actor.model.model_path: {path} has no config.json (a π0 checkpoint directory: "
                f"rlfleet's layout or transformers' PI0 layout)"
            )
        saved = read_config(path)  # inside the folder, bounded
        knobs = {k: sizes[k] for k in keep if k in sizes}
        if saved.get("model_type") == "pi0":
            return cls._from_transformers_layout(path, knobs, bool(sizes.get("pi05")), obs_specs, action_dim, kwargs)
        if saved.get("model_type") != "openpi":
            raise ValueError(
                f"actor.model.model_path: {path}/config.json has model_type "
                f"'{saved.get('model_type')}'; model_type 'openpi' loads 'openpi' (rlfleet's layout) "
                f"or 'pi0' (transformers' PI0 layout)"
            )
        if not has_file(path, "model.safetensors"):
            raise FileNotFoundError(
                f"actor.model.model_path: {path} needs model.safetensors next to config.json "
                f"(rlfleet's π0 checkpoint layout, written by save_pretrained)"
            )
        arch = saved.get("openpi", {})
        if not isinstance(arch, dict):
            raise BadFile(path / "config.json", "openpi", "a JSON object of sizes", type(arch).__name__)
        check_sizes(arch, path / "config.json", "openpi")
        headers = tensor_headers(path, ["model.safetensors"])  # checked before anything is built or read
        tokenizer = load_hf_tokenizer(path / "tokenizer", within=path) if (path / "tokenizer").is_dir() else None

        def make():
            return cls(obs_specs, action_dim, sizes={**arch, **knobs}, tokenizer=tokenizer, **kwargs)

        check_build_fits(make, elements(headers), path / "config.json", "openpi")
        policy = make()
        missing, unexpected = policy.load_state_dict(load_tensors(path, ["model.safetensors"]), strict=False)
        fresh = ("value_head.", "noise_head.")  # a fresh critic and noise head are expected on an SFT model
        missing = [k for k in missing if not k.startswith(fresh)]
        unexpected = [k for k in unexpected if not k.startswith(fresh)]
        if missing or unexpected:
            raise ValueError(f"{path}/model.safetensors: missing tensors {missing[:3]}, unexpected {unexpected[:3]}")
        return policy

    @classmethod
    def _from_transformers_layout(cls, path, knobs, pi05, obs_specs, action_dim, kwargs) -> Pi0Policy:
        """transformers' own PI0 checkpoint: loaded by PI0ForConditionalGeneration.from_pretrained (local files only,
        float32, sharding and key names handled by transformers); the value head and noise head start fresh."""
        from transformers import PI0ForConditionalGeneration

        if pi05:
            raise ValueError(
                f"actor.model.openpi.pi05: {path} is a transformers π0 checkpoint (model_type pi0); "
                f"transformers has no π0.5 class, so π0.5 loads only from rlfleet's layout"
            )
        from rlfleet.policies.model_folder import (
            check_build_fits,
            check_sizes,
            elements,
            has_file,
            read_config,
            shard_names,
            tensor_headers,
        )
        from rlfleet.untrusted import BadFile

        tokenizer_dir = path / "tokenizer" if (path / "tokenizer").is_dir() else path
        if not has_tokenizer_files(tokenizer_dir):
            raise FileNotFoundError(
                f"actor.model.model_path: {path} is a transformers π0 checkpoint without its "
                f"tokenizer (tokenizer.json / tokenizer.model / tokenizer_config.json, PaliGemma's, "
                f"in the directory or in tokenizer/)"
            )
        # what transformers' from_pretrained reads, checked first: config.json (sizes bounded), the weights (safetensors
        # only, each shard named by the index inside the folder, every header consistent), no peft adapter (it would
        # be applied with sizes of its own), generation_config.json bounded
        source = path / "config.json"
        config = read_config(path)
        check_sizes(config, source)
        if has_file(path, "adapter_config.json"):
            raise BadFile(
                path / "adapter_config.json",
                "file",
                "no peft adapter beside a transformers π0 checkpoint "
                "(rlfleet loads the full weights; merge the adapter into them first)",
            )
        read_config(path, "generation_config.json", required=False)
        shards = shard_names(path)
        if not shards:
            raise FileNotFoundError(
                f"actor.model.model_path: {path} has no model.safetensors(.index.json) "
                f"(transformers' π0 layout; rlfleet reads no pickled weights)"
            )
        headers = tensor_headers(path, shards)
        from transformers import PI0Config

        try:
            pi0_config = PI0Config.from_dict(config)
        except Exception as exc:  # noqa: BLE001 - transformers' own validation of the config's fields
            raise BadFile(
                source,
                "config",
                "a transformers PI0Config",
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}",
            ) from None
        import copy

        check_build_fits(lambda: PI0ForConditionalGeneration(copy.deepcopy(pi0_config)), elements(headers), source)
        model = PI0ForConditionalGeneration.from_pretrained(
            str(path),
            config=pi0_config,
            local_files_only=True,
            dtype=torch.float32,
            use_safetensors=True,
            trust_remote_code=False,
        )
        return cls(
            obs_specs,
            action_dim,
            sizes=knobs,
            pretrained=model,
            tokenizer=load_hf_tokenizer(tokenizer_dir, within=path),
            **kwargs,
        )
