"""An EAGLE-3 head trained for a benchmark model, as heads are trained for real ones: on the
target's own greedy outputs, from its own hidden states (the stream entering layers 2, L // 2
and L - 3), to predict the token after next; its draft vocabulary is the tokens those outputs
use most (EAGLE-3's `d2t`). `noria bench spec`'s `eagle3t-K` rows draft with it.

The prompts are random ids of W1's lengths (not W1's own, which the benchmark then measures);
transformers computes the outputs and the states in float32. Training is the first draft
position only (teacher-forced states, no "training-time test" unrolling), a few hundred Adam
steps on the CPU: the lm_head and final norm start as the target's and stay frozen, the rest
learns. The head is then saved in SpecForge's layout and read by the real loading code.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from noria.bench.spec_models import write_eagle3_head
from noria.bench.workloads import write_checkpoint

DRAFT_VOCAB = 2048
SEQUENCES, PROMPT, OUTPUT = 96, 48, 160
STEPS, BATCH, LR = 300, 8, 2e-3


def trained_eagle3_checkpoint(model: Path) -> Path:
    """The trained head for `model`, made once beside it (a few minutes on two cores)."""
    path = model.with_name(f"{model.name}-eagle3-trained")
    if (path / "complete").exists():
        return path
    return write_checkpoint(path, lambda tmp: _train(model, tmp), model)


def _train(model: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = json.loads((model / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    aux = [2, n // 2, n - 3]
    target = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    rng = random.Random(7)
    prompts = torch.tensor([[rng.randrange(3, cfg["vocab_size"]) for _ in range(PROMPT)] for _ in range(SEQUENCES)])
    with torch.no_grad():
        seqs = torch.cat([target.generate(p, max_new_tokens=OUTPUT, min_new_tokens=OUTPUT, do_sample=False,
                                          eos_token_id=None, pad_token_id=0) for p in prompts.split(16)])
        states = [target(s[None, :-1], output_hidden_states=True).hidden_states for s in seqs]
        feats = torch.stack([torch.cat([h[i][0] for i in aux], -1) for h in states])  # [S, T-1, 3H]
    counts = torch.bincount(seqs[:, PROMPT:].flatten(), minlength=cfg["vocab_size"])
    ids = counts.argsort(descending=True)[:DRAFT_VOCAB].sort().values
    to_draft = torch.full((cfg["vocab_size"],), -100, dtype=torch.long)
    to_draft[ids] = torch.arange(len(ids))
    write_eagle3_head(model, out, draft_vocab=len(ids), aux=aux)  # the layout, then the trained values
    head = _Head(out, target, ids)
    opt = torch.optim.Adam(head.parameters(), lr=LR)
    g = torch.Generator().manual_seed(0)
    print(f"training an EAGLE-3 head for {model.name}: {SEQUENCES} greedy outputs, {STEPS} steps", flush=True)
    for step in range(STEPS):
        pick = torch.randint(0, SEQUENCES, (BATCH,), generator=g)
        tokens, labels = seqs[pick, 1:-1], to_draft[seqs[pick, 2:]]  # position q reads q + 1, predicts q + 2
        labels[:, :PROMPT - 2] = -100  # drafts are made for outputs only
        logits = head(tokens, feats[pick, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == STEPS - 1:
            hit = (logits.argmax(-1) == labels)[labels >= 0].float().mean()
            print(f"  step {step}: loss {loss.item():.3f}, next-but-one token right {hit.item():.0%}", flush=True)
    head.save(out, ids)


class _Head:
    """The head's forward in torch, trainable, over whole sequences (causal attention)."""

    def __init__(self, folder: Path, target: Any, ids: Any) -> None:
        import torch
        from safetensors.torch import load_file

        self.cfg = json.loads((folder / "config.json").read_text())
        self.t = load_file(folder / "model.safetensors")
        with torch.no_grad():
            for name, w in self.t.items():  # scaled to their inputs; the residual branches start small
                if w.dim() == 2:
                    w.normal_(0.0, (0.02 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
                              / w.shape[1] ** 0.5)
                elif name.endswith("norm.weight"):
                    w.fill_(1.0)
            self.t["lm_head.weight"] = target.lm_head.weight[ids].clone()
            self.t["norm.weight"] = target.model.norm.weight.clone()
        for name, w in self.t.items():
            w.requires_grad_(w.is_floating_point() and name not in ("lm_head.weight", "norm.weight"))
        self.embed = target.model.embed_tokens.weight.detach()

    def parameters(self) -> list[Any]:
        return [w for w in self.t.values() if w.requires_grad]

    def __call__(self, tokens: Any, hidden: Any) -> Any:
        import torch
        import torch.nn.functional as F

        t, p, c = self.t, "midlayer.", self.cfg
        heads, kv, hd, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]

        def rms(x: Any, w: Any) -> Any:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

        b, n = tokens.shape
        h = hidden @ t["fc.weight"].T
        x = torch.cat([rms(self.embed[tokens], t[p + "input_layernorm.weight"]), rms(h, t[p + "hidden_norm.weight"])], -1)
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.arange(n, dtype=torch.float32)[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

        def rope(z: Any) -> Any:
            return z * cos + torch.cat([-z[..., hd // 2:], z[..., :hd // 2]], -1) * sin

        q = rope((x @ t[p + "self_attn.q_proj.weight"].T).view(b, n, heads, hd).transpose(1, 2))
        k = rope((x @ t[p + "self_attn.k_proj.weight"].T).view(b, n, kv, hd).transpose(1, 2))
        v = (x @ t[p + "self_attn.v_proj.weight"].T).view(b, n, kv, hd).transpose(1, 2)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, heads * hd)
        h = a @ t[p + "self_attn.o_proj.weight"].T + h
        m = rms(h, t[p + "post_attention_layernorm.weight"])
        h = (F.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) \
            @ t[p + "mlp.down_proj.weight"].T + h
        return rms(h, t["norm.weight"]) @ t["lm_head.weight"].T

    def save(self, folder: Path, ids: Any) -> None:
        import torch
        from safetensors.torch import save_file

        tensors = {k: v.detach().contiguous() for k, v in self.t.items()}
        tensors["d2t"] = ids - torch.arange(len(ids))
        tensors["t2d"] = torch.zeros(self.embed.shape[0], dtype=torch.bool)
        tensors["t2d"][ids] = True
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
