#!/usr/bin/env python3
"""gen_model_fixtures.py - HF transformers reference data for tests/test_model_hf.c.

Writes (all deterministic: fixed seeds, fp32, eager attention, CPU):

1. Tiny random-weight HF checkpoints, one per family switch the forward has:
     tests/data/tiny-llama/  llama: Llama 3.1 rope scaling (all three frequency
                             regions hit: original_max_position_embeddings 32),
                             untied lm_head
     tests/data/tiny-qwen2/  qwen2: q/k/v bias, tied embeddings
     tests/data/tiny-qwen3/  qwen3: per-head q/k RMSNorm, explicit head_dim 32
                             (n_heads * head_dim != hidden), tied embeddings
   each = config.json + generation_config.json + model.safetensors (float32).
   Weights are re-drawn with O(1) activations (std 1/sqrt(fan_in), norm weights
   1 +- 0.1, biases std 0.1) so that the logits are not near-uniform.
   References tests/data/hf-ref/tiny-<family>.bin: for 3 random token sequences
   (lengths 20, 45, 70) the full logits at every position.

2. SmolLM2-135M-Instruct (models/SmolLM2-135M-Instruct.Q4_1.gguf, loaded by
   transformers' GGUF loader: dequantized to float32, eager attention).
   3 prompts rendered with the model's chat template (a short question, a
   two-turn chat, and "summarize this speech" over the start of a State of the
   Union address from /work/shared/data/sotu, >= 2,000 tokens). Stored in
   tests/data/hf-ref/smollm2-135m.bin per prompt i:
     p<i>.tokens      i32 [T]      prompt token ids
     p<i>.top1        i32 [T]      HF argmax of the next-token logits at every position
     p<i>.gap         f32 [T]      top-1 minus top-2 logit (how close a tie is)
     p<i>.topk_pos    i32 [P]      every STRIDE-th position and the last one
     p<i>.topk_ids    i32 [P, K]   the K largest logits' ids there, descending
     p<i>.topk_vals   f32 [P, K]   and their values
     p<i>.last_logits f32 [V]      the full logits at the last prompt position
     p<i>.greedy      i32 [64]     model.generate(do_sample=False, 64 new tokens,
                                   EOS does not stop it)
     p<i>.greedy_gap  f32 [64]     top-1 minus top-2 logit at each generated step

File format of tests/data/hf-ref/*.bin ("named arrays", little-endian):
     magic   8 bytes  "LTHREF01"
     u32     n_arrays
     per array: u32 name_len, name (ASCII, no NUL), u32 dtype (0 = f32, 1 = i32),
                u32 ndim, u32 shape[ndim], then prod(shape) elements.

1b. Tiny mixture-of-experts checkpoints (`moe`), published layouts (one tensor per
   expert), with the same 3 sequences' logits plus `greedy` i32 [64] / `greedy_gap`
   f32 [64] (generate() continuing seq0):
     tests/data/tiny-qwen3-moe/  qwen3_moe: 8 experts, 2 per token, normalized top-k,
                                 layer 1 dense (mlp_only_layers), token-specialized
                                 experts (decisive routing, see specialize_experts)
     tests/data/tiny-glm4-moe-lite/  glm4_moe_lite: MLA (q/kv low rank, interleaved RoPE
                                 key shared by the heads), sigmoid routing with a
                                 selection bias in 2 groups (1 kept), token-specialized
                                 experts within a group, a shared expert,
                                 routed scaling 1.8, layer 0 dense, plus an unused
                                 multi-token-prediction layer (num_nextn_predict_layers 1)

1c. A tiny hybrid linear-attention checkpoint (`hybrid`): tests/data/tiny-qwen3_5/, the
   Qwen3.5 / 3.6 family (model_type qwen3_5): 4 layers [DeltaNet, DeltaNet, gated full
   attention, DeltaNet], DeltaNet with 2 key heads / 4 value heads of 16 (grouped value
   heads), conv kernel 4, attention 4 q / 2 kv heads of 32 with partial rotary 0.25 (8
   rotated dims), zero-centred norms. Saved in the published multimodal layout
   (Qwen3_5ForConditionalGeneration: config under text_config, tensors under
   model.language_model., plus one stand-in vision-tower tensor model.visual.* the
   loaders must skip); the reference runs Qwen3_5ForCausalLM on the same tensors.
   tests/data/hf-ref/tiny-qwen3_5.bin: seq0..2 (20, 45, 70 tokens) full logits, `greedy` /
   `greedy_gap` (64 tokens after seq0), and a 2,000-token sequence crossing 32 chunks of
   the chunked delta rule: long.tokens [2000], long.top1 / long.gap [2000], long.pos
   (every 8th position and the last) with long.logits [P, V] there, long.greedy /
   long.greedy_gap (64 tokens after it).

Needs: torch, transformers (>= 5: qwen3_moe, glm4_moe_lite; qwen3_5), gguf, safetensors,
accelerate (GGUF loading), in tests/gen/.venv (ignored):
  python3 -m venv tests/gen/.venv && tests/gen/.venv/bin/pip install torch transformers \
      safetensors gguf accelerate
Run from anywhere: tests/gen/.venv/bin/python tests/gen/gen_model_fixtures.py [tiny] [moe] [hybrid] [smollm2]
(moe:qwen3-moe or moe:glm4-moe-lite: that MoE family alone)
"""
import json
import os
import struct
import sys

import numpy as np
import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DATA = os.path.join(ROOT, "tests", "data")
REF = os.path.join(DATA, "hf-ref")
MODEL_DIR = os.path.join(ROOT, "models")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOTU = "/work/shared/data/sotu/1962_john_f_kennedy_d.txt"
STRIDE, TOPK, N_GEN = 16, 32, 64

torch.set_num_threads(2)


def write_arrays(path, arrays):
    """arrays: list of (name, np.ndarray of float32 or int32)."""
    with open(path, "wb") as f:
        f.write(b"LTHREF01")
        f.write(struct.pack("<I", len(arrays)))
        for name, a in arrays:
            a = np.ascontiguousarray(a)
            if a.dtype == np.float32:
                dt = 0
            elif a.dtype == np.int32:
                dt = 1
            else:
                raise TypeError(f"{name}: dtype {a.dtype}")
            nb = name.encode("ascii")
            f.write(struct.pack("<I", len(nb)) + nb)
            f.write(struct.pack("<II", dt, a.ndim))
            f.write(struct.pack("<%dI" % a.ndim, *a.shape))
            f.write(a.astype(a.dtype.newbyteorder("<")).tobytes())
    print(f"wrote {os.path.relpath(path, ROOT)} ({os.path.getsize(path)} bytes)")


# ---- 1. tiny checkpoints -------------------------------------------------------

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def tiny_configs():
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config
    return {
        "llama": LlamaConfig(**COMMON, tie_word_embeddings=False, rope_theta=10000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 32}),
        "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=True, rope_theta=1000000.0),
        "qwen3": Qwen3Config(**COMMON, tie_word_embeddings=True, rope_theta=1000000.0,
                             head_dim=32),
    }


def redraw_weights(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # Linear [out, in]
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def legacy_rope_config(path):
    """Rewrites transformers-5 `rope_parameters` as the `rope_theta` + `rope_scaling`
    (+ `torch_dtype`) spelling of real Llama 3.1 checkpoints, so that both spellings
    are covered (qwen2/qwen3 keep the new one). transformers reads both."""
    c = json.load(open(path))
    rp = c.pop("rope_parameters")
    c["rope_theta"] = rp.pop("rope_theta")
    c["rope_scaling"] = rp
    c["torch_dtype"] = c.pop("dtype")
    with open(path, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
        f.write("\n")


def gen_tiny():
    from transformers import AutoModelForCausalLM
    for i, (fam, cfg) in enumerate(tiny_configs().items()):
        torch.manual_seed(100 + i)
        cfg._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        redraw_weights(model, 1000 + i)
        out_dir = os.path.join(DATA, f"tiny-{fam}")
        model.save_pretrained(out_dir, safe_serialization=True)
        model.generation_config.save_pretrained(out_dir)
        if fam == "llama":
            legacy_rope_config(os.path.join(out_dir, "config.json"))
        # reload from disk: the reference is what the files say
        model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        g = torch.Generator().manual_seed(2000 + i)
        arrays = []
        for s, n in enumerate((20, 45, 70)):
            ids = torch.randint(0, cfg.vocab_size, (1, n), generator=g)
            with torch.no_grad():
                logits = model(ids).logits[0].float().numpy()
            arrays += [(f"seq{s}.tokens", ids[0].numpy().astype(np.int32)),
                       (f"seq{s}.logits", logits.astype(np.float32))]
        write_arrays(os.path.join(REF, f"tiny-{fam}.bin"), arrays)
        for f in sorted(os.listdir(out_dir)):
            print(f"  {fam}/{f}: {os.path.getsize(os.path.join(out_dir, f))} bytes")


# ---- 1b. tiny mixture-of-experts / latent-attention checkpoints ------------------------

MOE_COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  max_position_embeddings=160, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)


def moe_configs():
    from transformers import Glm4MoeLiteConfig, Qwen3MoeConfig
    return {
        # layer 1 dense (mlp_only_layers), layers 0 and 2 routed: 8 experts, 2 per token
        "qwen3-moe": Qwen3MoeConfig(**MOE_COMMON, num_key_value_heads=2, head_dim=32,
                                    intermediate_size=96, moe_intermediate_size=32,
                                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                    decoder_sparse_step=1, mlp_only_layers=[1],
                                    rope_theta=1000000.0),
        # MLA (q_lora 32, kv_lora 32, nope 16 + rope 8 interleaved, v 16), layer 0 dense, then
        # 8 routed experts in 2 groups (1 kept), 2 per token, 1 shared, scaling 1.8
        "glm4-moe-lite": Glm4MoeLiteConfig(**MOE_COMMON, num_key_value_heads=4,
                                           intermediate_size=96, moe_intermediate_size=32,
                                           n_routed_experts=8, n_shared_experts=1,
                                           num_experts_per_tok=2, n_group=2, topk_group=1,
                                           routed_scaling_factor=1.8, norm_topk_prob=True,
                                           q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                                           qk_rope_head_dim=8, v_head_dim=16,
                                           rope_interleave=True, rope_theta=10000.0),
    }


# router weight std (x 1/sqrt(hidden)) and selection-bias std per tiny MoE family
ROUTER = {"qwen3-moe": (0.5, 0.1), "glm4-moe-lite": (0.2, 0.05)}
# redraw seed per family (qwen3-moe: 3002 among the few tried keeps the bf16 run closest)
MOE_SEED = {"qwen3-moe": 3002, "glm4-moe-lite": 3001}
# token-specialized experts (embedding component beta, router component c), see
# specialize_experts. GLM's pair lies in one expert group (group routing keeps 1 of 2),
# so the group choice is as decisive as the expert choice; its sigmoid saturates, so the
# router component is small (c 1: with c >= 2 many experts sit near 1 and the selection
# bias decides between them) and so is the iid part (0.2). Among the few tried, this
# keeps every fp32 margin over 7 sequences (the test_hf_logits ones and 3 more, 924
# routed tokens) >= 1.1e-2 for the experts and >= 0.22 for the groups.
SPECIALIZE = {"qwen3-moe": (1.5, 3.0), "glm4-moe-lite": (2.0, 1.0)}


def specialize_experts(model, seed, beta, c):
    """Makes softmax top-k routing decisive, as token-dependent as in trained MoEs (whose
    routing follows the token id closely): a random iid router puts the 2nd and 3rd expert
    within bf16 rounding of each other for ~4% of the tokens per layer, whatever the router
    scale (the margin and the rounding error both scale with it), and a flipped expert moves
    the logits by up to ~0.3 (max abs / max |logit|). Here every token id gets a random pair
    of experts: its embedding [D] gains beta * sqrt(D) * (v_a + v_b) / sqrt(2) and every
    router [E, D] gains c * V, where V [E, D] has orthonormal rows v_e; the iid router part
    keeps the routing input-dependent beyond the token id. With expert groups (GLM:
    n_group, topk_group) both experts of a pair come from one random group. The same
    near-tie hits GLM's sigmoid routing, whose bf16 flips moved transformers' own bf16
    logits 0.6 off fp32 with a small selection bias and lethe's CUDA vs CPU checks
    past 3e-2 with a large one."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    with torch.no_grad():
        emb = model.model.embed_tokens.weight  # [V, D]
        n_vocab, d = emb.shape
        n_exp = getattr(cfg, "n_routed_experts", None) or cfg.num_experts
        n_group = getattr(cfg, "n_group", 1) or 1
        gs = n_exp // n_group
        v = torch.linalg.qr(torch.randn(d, n_exp, generator=g))[0].T  # [E, D]
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(c * v)
        for t in range(n_vocab):
            grp = int(torch.randint(n_group, (1,), generator=g))
            pair = grp * gs + torch.randperm(gs, generator=g)[:2]
            emb[t] += beta * d ** 0.5 * v[pair].sum(0) / 2 ** 0.5


def redraw_moe(model, seed, router=2.0, bias=0.1):
    """O(1) activations as redraw_weights, with 3-D expert tensors [E, out, in] scaled by
    their own fan-in, and a router with spread-out logits so that routing is decisive."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(router * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(bias * torch.randn(b.shape, generator=g))


def split_experts(out_dir):
    """transformers 5 saves routed experts fused ([E, 2F, D] gate_up_proj, [E, D, F]
    down_proj); published checkpoints (Qwen3-30B-A3B, GLM-4.7-Flash) keep one tensor per
    expert and projection (mlp.experts.<e>.{gate,up,down}_proj.weight). Rewrites the
    file in the published layout, which transformers reads back (its conversion map)."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(out_dir, "model.safetensors")
    t = load_file(path)
    out = {}
    for k, v in t.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            pre = k[: -len("gate_up_proj")]
            f = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = v[e, :f].contiguous()
                out[f"{pre}{e}.up_proj.weight"] = v[e, f:].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v
    save_file(out, path, metadata={"format": "pt"})


def add_nextn_layer(out_dir, cfg):
    """Published GLM-4.7-Flash checkpoints carry a multi-token-prediction layer after the
    decoder layers (model.layers.<n_layers>.*, num_nextn_predict_layers 1) that
    generation does not use; transformers skips it on load. Adds one (random) so the
    loaders' handling of it is tested."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(out_dir, "model.safetensors")
    t = load_file(path)
    n, d = cfg.num_hidden_layers, cfg.hidden_size
    g = torch.Generator().manual_seed(77)
    for name in ("enorm.weight", "hnorm.weight", "input_layernorm.weight"):
        t[f"model.layers.{n}.{name}"] = torch.ones(d)
    t[f"model.layers.{n}.eh_proj.weight"] = torch.randn(d, 2 * d, generator=g)
    save_file(t, path, metadata={"format": "pt"})
    c = json.load(open(os.path.join(out_dir, "config.json")))
    c["num_nextn_predict_layers"] = 1
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
        f.write("\n")


def gen_moe(only=None):
    from transformers import AutoModelForCausalLM
    for i, (fam, cfg) in enumerate(moe_configs().items()):
        if only and fam not in only:
            continue
        torch.manual_seed(300 + i)
        cfg._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        redraw_moe(model, MOE_SEED[fam], *ROUTER[fam])
        if fam in SPECIALIZE:
            specialize_experts(model, MOE_SEED[fam] + 7, *SPECIALIZE[fam])
        out_dir = os.path.join(DATA, f"tiny-{fam}")
        model.save_pretrained(out_dir, safe_serialization=True)
        model.generation_config.save_pretrained(out_dir)
        split_experts(out_dir)
        if fam == "glm4-moe-lite":
            add_nextn_layer(out_dir, cfg)
        model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        g = torch.Generator().manual_seed(4000 + i)
        arrays = []
        for s, n in enumerate((20, 45, 70)):
            ids = torch.randint(0, cfg.vocab_size, (1, n), generator=g)
            with torch.no_grad():
                logits = model(ids).logits[0].float().numpy()
            arrays += [(f"seq{s}.tokens", ids[0].numpy().astype(np.int32)),
                       (f"seq{s}.logits", logits.astype(np.float32))]
        # greedy continuation of the first sequence, EOS does not stop it
        ids = torch.tensor(arrays[0][1][None].astype(np.int64))
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_GEN,
                             min_new_tokens=0, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        greedy = gen.sequences[0, ids.shape[1]:]
        assert greedy.shape[0] == N_GEN, greedy.shape
        g2 = torch.topk(torch.stack([x[0] for x in gen.scores]).float(), 2, dim=-1).values
        arrays += [("greedy", greedy.numpy().astype(np.int32)),
                   ("greedy_gap", (g2[:, 0] - g2[:, 1]).numpy().astype(np.float32))]
        print(f"{fam}: greedy min gap {float((g2[:, 0] - g2[:, 1]).min()):.2e}")
        write_arrays(os.path.join(REF, f"tiny-{fam}.bin"), arrays)
        for f in sorted(os.listdir(out_dir)):
            print(f"  {fam}/{f}: {os.path.getsize(os.path.join(out_dir, f))} bytes")


# ---- 1c. tiny hybrid linear-attention checkpoint (qwen3_5) -------------------------

HYB_LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def hybrid_config():
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=4, layer_types=HYB_LAYERS,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=16,
                             linear_conv_kernel_dim=4, max_position_embeddings=4096,
                             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                             tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                              "partial_rotary_factor": 0.25})


def redraw_hybrid(model, seed):
    """O(1) activations as redraw_weights for the qwen3_5 layout: its RMSNorms store w - 1
    (0.1 randn: applied as 1 + w), the DeltaNet output norm stores w (1 + 0.1 randn), the
    decay A = exp(A_log) uniform in [0.01, 1] (memory over hundreds of tokens), dt_bias
    0.1 randn, conv taps [C, 1, K] randn / sqrt(K)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.log(0.01 + 0.99 * torch.rand(p.shape, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # Linear [out, in], conv1d [C, 1, K]
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def to_multimodal_layout(out_dir):
    """Rewrites a saved Qwen3_5ForCausalLM folder as Qwen3_5ForConditionalGeneration
    publishes it: config.json wraps the text config under text_config, text tensors move
    under model.language_model., and a (stand-in) vision tensor sits beside them."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(out_dir, "model.safetensors")
    t = load_file(path)
    out = {}
    for k, v in t.items():
        out["model.language_model." + k[len("model."):] if k.startswith("model.") else k] = v
    out["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2, 2)
    save_file(out, path, metadata={"format": "pt"})
    c = json.load(open(os.path.join(out_dir, "config.json")))
    text = {k: v for k, v in c.items() if k not in ("architectures", "transformers_version")}
    wrapped = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
               "tie_word_embeddings": c["tie_word_embeddings"], "text_config": text,
               "transformers_version": c.get("transformers_version")}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(wrapped, f, indent=2, sort_keys=True)
        f.write("\n")


def greedy_arrays(model, ids, prefix):
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_GEN,
                         min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    greedy = gen.sequences[0, ids.shape[1]:]
    assert greedy.shape[0] == N_GEN, greedy.shape
    g2 = torch.topk(torch.stack([x[0] for x in gen.scores]).float(), 2, dim=-1).values
    gap = (g2[:, 0] - g2[:, 1]).numpy().astype(np.float32)
    print(f"hybrid {prefix}greedy: min gap {float(gap.min()):.2e}")
    return [(f"{prefix}greedy", greedy.numpy().astype(np.int32)), (f"{prefix}greedy_gap", gap)]


def gen_hybrid():
    from transformers import Qwen3_5ForCausalLM
    cfg = hybrid_config()
    torch.manual_seed(500)
    cfg._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(cfg).to(torch.float32).eval()
    redraw_hybrid(model, 5000)
    out_dir = os.path.join(DATA, "tiny-qwen3_5")
    model.save_pretrained(out_dir, safe_serialization=True)
    model.generation_config.save_pretrained(out_dir)
    model = Qwen3_5ForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(6000)
    arrays = []
    for s, n in enumerate((20, 45, 70)):
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=g)
        with torch.no_grad():
            logits = model(ids).logits[0].float().numpy()
        arrays += [(f"seq{s}.tokens", ids[0].numpy().astype(np.int32)),
                   (f"seq{s}.logits", logits.astype(np.float32))]
    arrays += greedy_arrays(model, torch.tensor(arrays[0][1][None].astype(np.int64)), "")
    T = 2000
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    top2 = torch.topk(logits, 2, dim=-1)
    pos = sorted(set(range(0, T, 8)) | {T - 1})
    gap = (top2.values[:, 0] - top2.values[:, 1]).numpy().astype(np.float32)
    print(f"hybrid long: {T} tokens, min top-1 gap {float(gap.min()):.2e}")
    arrays += [("long.tokens", ids[0].numpy().astype(np.int32)),
               ("long.top1", top2.indices[:, 0].numpy().astype(np.int32)), ("long.gap", gap),
               ("long.pos", np.array(pos, dtype=np.int32)),
               ("long.logits", logits[pos].numpy().astype(np.float32))]
    arrays += greedy_arrays(model, ids, "long.")
    write_arrays(os.path.join(REF, "tiny-qwen3_5.bin"), arrays)
    to_multimodal_layout(out_dir)
    for f in sorted(os.listdir(out_dir)):
        print(f"  qwen3_5/{f}: {os.path.getsize(os.path.join(out_dir, f))} bytes")


# ---- 2. SmolLM2-135M --------------------------------------------------------------

def speech_prompt(tok, min_tokens=2000):
    """The speech's first sentences, as many as needed for >= min_tokens prompt tokens."""
    text = open(SOTU, encoding="utf-8").read().strip()
    sentences = [x + "." for x in text.split(". ") if x]
    for n in range(40, len(sentences), 5):
        msgs = [{"role": "user", "content": "Summarize the main points of this State of the Union "
                 "address in a few sentences.\n\n" + " ".join(sentences[:n])}]
        s = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        if len(tok(s, add_special_tokens=False).input_ids) >= min_tokens:
            return msgs
    raise RuntimeError(f"{SOTU}: speech too short")


def gen_smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, gguf_file=GGUF_NAME,
                                                 dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    chats = [
        [{"role": "user", "content": "What is the capital of France? Explain its history in detail."}],
        [{"role": "system", "content": "You are a concise assistant."},
         {"role": "user", "content": "Give me three tips for learning to play the guitar."},
         {"role": "assistant", "content": "1. Practice daily. 2. Learn basic chords first. "
          "3. Play songs you enjoy."},
         {"role": "user", "content": "Now explain the second tip step by step."}],
        speech_prompt(tok),
    ]
    arrays = []
    for i, msgs in enumerate(chats):
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
        T = ids.shape[1]
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        top2 = torch.topk(logits, 2, dim=-1)
        pos = sorted(set(range(0, T, STRIDE)) | {T - 1})
        tk = torch.topk(logits[pos], TOPK, dim=-1)
        # explicit all-ones mask: otherwise generate() infers one from pad_token_id, which
        # is <|im_end|> here, and would mask the prompt's own <|im_end|> tokens
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_GEN,
                             min_new_tokens=0, do_sample=False,
                             eos_token_id=None, pad_token_id=model.config.eos_token_id,
                             output_scores=True, return_dict_in_generate=True)
        greedy = gen.sequences[0, T:]
        assert greedy.shape[0] == N_GEN, greedy.shape
        g2 = torch.topk(torch.stack([s[0] for s in gen.scores]).float(), 2, dim=-1).values
        arrays += [
            (f"p{i}.tokens", ids[0].numpy().astype(np.int32)),
            (f"p{i}.top1", top2.indices[:, 0].numpy().astype(np.int32)),
            (f"p{i}.gap", (top2.values[:, 0] - top2.values[:, 1]).numpy().astype(np.float32)),
            (f"p{i}.topk_pos", np.array(pos, dtype=np.int32)),
            (f"p{i}.topk_ids", tk.indices.numpy().astype(np.int32)),
            (f"p{i}.topk_vals", tk.values.numpy().astype(np.float32)),
            (f"p{i}.last_logits", logits[T - 1].numpy().astype(np.float32)),
            (f"p{i}.greedy", greedy.numpy().astype(np.int32)),
            (f"p{i}.greedy_gap", (g2[:, 0] - g2[:, 1]).numpy().astype(np.float32)),
        ]
        print(f"prompt {i}: {T} tokens, min top-1 gap {float((top2.values[:, 0] - top2.values[:, 1]).min()):.2e}, "
              f"greedy min gap {float((g2[:, 0] - g2[:, 1]).min()):.2e}")
        print("  ->", repr(tok.decode(greedy)))
    write_arrays(os.path.join(REF, "smollm2-135m.bin"), arrays)


if __name__ == "__main__":
    what = sys.argv[1:] or ["tiny", "moe", "hybrid", "smollm2"]
    os.makedirs(REF, exist_ok=True)
    if "tiny" in what:
        gen_tiny()
    if "moe" in what:
        gen_moe()
    # one MoE family alone: moe:qwen3-moe, moe:glm4-moe-lite
    only = [w[4:] for w in what if w.startswith("moe:")]
    if only:
        gen_moe(only)
    if "hybrid" in what:
        gen_hybrid()
    if "smollm2" in what:
        gen_smollm2()
