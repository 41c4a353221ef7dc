"""The roofline of each recorded step: the least time the machine needs for it.

A step's floor is the larger of
  (a) the bytes it must move over the streaming bandwidth (bench/roofline_machine.py, copy_):
      every linear weight once (q/k/v, o, gate/up, down per layer; the LM head
      once when any row samples), the final and per-layer norm weights, the
      embedding rows of its tokens (a mixture-of-experts layer: its router, any shared
      expert, and the experts its tokens route to, see `Shape.expected_experts`), the
      K/V rows each sequence attends to
      (per layer: its sequence length x kv heads x head dim x 2 (K and V) x
      dtype bytes), the K/V rows it writes and the logits of its sampling rows;
      other activations are left out (an ideal kernel keeps them in cache);
  (b) its floating-point work over the measured GEMM peak of its dtype (the float32 GEMM's, or
      for 2-byte weights the native bf16 GEMM's: roofline_machine.Machine.gflops): 2 x the
      layers' linear parameters a token goes through (in a sparse layer its k
      experts', not all of them) x tokens, 2 x the LM head's parameters x
      sampling rows, and attention's QK and PV products (a query token at
      position p attends to p + 1 keys: 4 x heads x head dim FLOPs per key).
Norms, rotary, SiLU and softmax are left out of (b): a few FLOPs per
activation, next to the thousands per token of the matmuls.

Summed over a run's steps that is the run's floor; the measured time of each
step is what the worker records around its forward pass and logits
(bench/step_log.py, perf_counter, during the real run: CPU execution is
synchronous, so the time is the step's own).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noria.bench.roofline_machine import Machine, describe
from noria.protocol.model_spec import ModelSpec, model_spec, read_spec

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
# Row-count buckets for the table: [lo, hi] sequences in the step.
BUCKETS = ((1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 127), (128, 255), (256, 1 << 30))


@dataclass(frozen=True)
class Shape:
    """The sizes of a Llama-family model that its step costs depend on; for a mixture of
    experts (Mixtral, Qwen2-MoE, Qwen3-MoE) also how many of its layers are sparse, their
    experts, top-k, each expert's intermediate size and any shared expert's."""
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int = 4
    dtype: str = "float32"  # the weights' (float16 computes in float32 FMAs: Machine.gflops)
    sparse_layers: int = 0
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    # Quantized decoder-layer weights (protocol/quant_config.py): bytes per weight with their
    # scales, and the arithmetic they run ("int8": W8A8's int8 dot products; "float32": a
    # weight-only scheme widened to float32 FMAs); 0 / "": the dtype's.
    layer_weight_bytes: float = 0.0
    head_weight_bytes: float = 0.0  # a quantized lm_head's bytes per weight; 0: the dtype's
    layer_compute: str = ""

    @staticmethod
    def from_spec(spec: ModelSpec) -> Shape:
        sparse = spec.num_experts > 0
        return Shape(hidden=spec.hidden_size, intermediate=spec.intermediate_size, layers=spec.num_layers,
                     heads=spec.num_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, vocab=spec.vocab_size,
                     dtype_bytes=DTYPE_BYTES.get(spec.dtype or "float32", 4), dtype=spec.dtype or "float32",
                     sparse_layers=sum(spec.sparse_layers),
                     experts=spec.num_experts, top_k=spec.num_experts_per_tok if sparse else 0,
                     expert_intermediate=spec.moe_intermediate_size if sparse else 0,
                     shared_intermediate=spec.shared_expert_intermediate_size,
                     **_quantized(spec))

    @staticmethod
    def from_config(cfg: Mapping[str, Any]) -> Shape:
        return Shape.from_spec(config_spec(cfg))

    @staticmethod
    def from_checkpoint(path: str | Path) -> Shape:
        """A checkpoint folder's shape; a GGUF file's is read through its folder view, as noria loads it."""
        if str(path).lower().endswith(".gguf"):
            from noria.frontend.demo_model import resolve_model

            path = resolve_model(str(path))
        return Shape.from_spec(read_spec(path))

    @property
    def layer_params(self) -> int:
        """Linear weights of all decoder layers (q, k, v, o, gate, up, down; a sparse layer's
        router, shared expert and every expert)."""
        return self._params(self.experts)

    def _params(self, experts: float) -> int:
        """Linear weights of all decoder layers counting `experts` of each sparse layer's experts."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden
        dense = self.layers - self.sparse_layers
        sparse = self.experts * self.hidden + (3 * self.shared_intermediate + (1 if self.shared_intermediate else 0)
                                               ) * self.hidden
        routed = round(self.sparse_layers * experts * 3 * self.hidden * self.expert_intermediate)
        return self.layers * attention + dense * 3 * self.hidden * self.intermediate + self.sparse_layers * sparse \
            + routed

    def expected_experts(self, tokens: int) -> float:
        """The distinct experts one sparse layer runs for `tokens` tokens, expected if each
        token's top-k were k distinct experts drawn uniformly and tokens independently:
        E (1 - (1 - k/E)^T). The worker does not report the experts a step actually hit;
        a trained router's skew makes the true count lower at a few tokens."""
        if not self.sparse_layers or tokens <= 0:
            return 0.0
        return self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** tokens)

    def weight_bytes(self, tokens: int) -> int:
        """The decoder layers' linear weights one step of `tokens` tokens reads."""
        return round(self._params(self.expected_experts(tokens)) * (self.layer_weight_bytes or self.dtype_bytes))

    @property
    def token_params(self) -> int:
        """Linear weights one token goes through in the decoder layers (its k experts per sparse layer)."""
        return self._params(self.top_k)

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def kv_row_bytes(self) -> int:
        """One token's K and V in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


def _scheme_bytes(scheme: Any, in_features: int) -> float:
    """Bytes per weight of a quantized scheme, its float32 scales (zero points, minimums) included."""
    group = scheme.group or in_features
    per_group = 1 + (0 if scheme.symmetric else 1) + (1 if getattr(scheme, "minimum", False) else 0)
    return scheme.bits / 8 + 4 * per_group / group


def _quantized(spec: ModelSpec) -> dict[str, Any]:
    """The Shape fields of a quantized checkpoint: the decoder layers' bytes per weight averaged
    over every linear module by its size (GGUF mixes types), the lm_head's, and the arithmetic
    most of the layers' weights run (int8 where activations are rounded to int8: W8A8, and 4- and
    8-bit integer weight-only schemes on a CPU unless $NORIA_CPU_W4A16); none for float weights."""
    q = spec.quantization
    if q is None:
        return {}
    from noria.protocol import switches

    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    parts = {"self_attn.q_proj": (spec.num_heads * d, h), "self_attn.k_proj": (spec.num_kv_heads * d, h),
             "self_attn.v_proj": (spec.num_kv_heads * d, h), "self_attn.o_proj": (h, spec.num_heads * d),
             "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
    total = weighted = int8 = fp8_dot = 0.0
    for i in range(spec.num_layers):
        for name, (rows, cols) in parts.items():
            scheme = q.scheme_for(f"model.layers.{i}.{name}")
            n = rows * cols
            total += n
            if scheme is None:
                weighted += n * DTYPE_BYTES.get(spec.dtype or "float32", 4)
                continue
            weighted += n * _scheme_bytes(scheme, cols)
            # fp8 weights widen to bf16 for the bf16 dot on a CPU that has it, else to float32 FMAs
            # (worker/gemm_fp8_kernels.py).
            if scheme.kind == "fp8":
                fp8_dot += n if _fp8_dot() else 0
            elif scheme.act_int8 or (scheme.bits in (4, 8) and not switches.cpu_w4a16()):
                int8 += n
    head = q.scheme_for("lm_head")
    compute = "int8" if int8 > total / 2 else "bfloat16" if fp8_dot > total / 2 else "float32"
    return {"layer_weight_bytes": weighted / total, "layer_compute": compute,
            "head_weight_bytes": 0.0 if head is None or spec.tie_word_embeddings else _scheme_bytes(head, h)}


def _fp8_dot() -> bool:
    from noria.worker import gemm_fp8_kernels

    return gemm_fp8_kernels.usable() and gemm_fp8_kernels.layout() == "dot"


def step_cost(shape: Shape, query_lens: list[int], seq_lens: list[int], num_sampled: int) -> tuple[int, int]:
    """(bytes, FLOPs) one step must move and compute (see the module's docstring)."""
    b = shape.dtype_bytes
    tokens = sum(query_lens)
    weights = shape.weight_bytes(tokens) + (2 * shape.layers + 1) * shape.hidden * b
    weights += round(shape.head_params * (shape.head_weight_bytes or b)) if num_sampled else 0
    moved = (weights + tokens * shape.hidden * b  # embedding rows
             + shape.layers * shape.kv_row_bytes * (sum(seq_lens) + tokens)  # K/V read and written
             + num_sampled * shape.vocab * 4)  # float32 logits out
    # Keys attended to by the tokens of one sequence: positions s-q .. s-1 see s-q+1 .. s keys.
    keys = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(query_lens, seq_lens, strict=True))
    flops = (2 * shape.token_params * tokens + 2 * shape.head_params * num_sampled
             + 4 * shape.layers * shape.heads * shape.head_dim * keys)
    return moved, flops


def config_spec(cfg: Mapping[str, Any] | ModelSpec) -> ModelSpec:
    """The spec of a config.json dict; a bare dict of sizes, naming neither architectures nor
    model_type (as the benchmarks write their shapes), is read as Llama's."""
    if isinstance(cfg, ModelSpec):
        return cfg
    if not cfg.get("architectures") and not cfg.get("model_type"):
        cfg = {**cfg, "model_type": "llama"}
    return model_spec(cfg)


def step_roofline(shape: Shape, machine: Machine, step: tuple) -> tuple[float, float, float]:
    """(memory seconds, compute seconds, measured seconds) of one recorded step."""
    query_lens, seq_lens, num_sampled, seconds = step
    moved, flops = step_cost(shape, query_lens, seq_lens, num_sampled)
    compute = flops / (machine.gflops(shape.dtype) * 1e9)
    if shape.layer_compute:  # the decoder layers' GEMMs at their own rate, the rest at the dtype's
        layers = 2 * shape.token_params * sum(query_lens)
        compute += layers / (machine.gflops(shape.layer_compute) * 1e9) - layers / (machine.gflops(shape.dtype) * 1e9)
    return moved / (machine.copy_gbs * 1e9), compute, seconds


def bucket_of(rows: int) -> tuple[int, int]:
    return next(b for b in BUCKETS if b[0] <= rows <= b[1])


def analyse(shape: Shape, machine: Machine, steps: list[tuple], wall_seconds: float) -> dict:
    """Per-run totals and a table by row count (decode-only steps apart from steps with a prefill)."""
    per = [step_roofline(shape, machine, s) for s in steps]
    floor = sum(max(m, c) for m, c, _ in per)
    forward = sum(t for _, _, t in per)
    groups: dict[tuple[str, int, int], list] = {}
    for s, (m, c, t) in zip(steps, per, strict=True):
        kind = "decode" if all(q == 1 for q in s[0]) else "prefill"
        groups.setdefault((kind, *bucket_of(len(s[0]))), []).append((sum(s[0]), m, c, t))
    table = []
    for (kind, lo, hi), xs in sorted(groups.items(), key=lambda kv: (kv[0][0] != "decode", kv[0][1])):
        n = len(xs)
        mem, comp = sum(x[1] for x in xs), sum(x[2] for x in xs)
        roof = sum(max(x[1], x[2]) for x in xs)
        table.append({"kind": kind, "rows": f"{lo}" if lo == hi else f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+",
                      "steps": n, "tokens_per_step": sum(x[0] for x in xs) / n,
                      "measured_ms": 1e3 * sum(x[3] for x in xs) / n, "roofline_ms": 1e3 * roof / n,
                      "memory_ms": 1e3 * mem / n, "compute_ms": 1e3 * comp / n,
                      "bound": "memory" if mem > comp else "compute"})
    return {"steps": len(steps), "floor_seconds": floor, "wall_seconds": wall_seconds,
            "forward_seconds": forward, "floor_of_wall": floor / wall_seconds if wall_seconds else 0.0,
            "floor_of_forward": floor / forward if forward else 0.0,
            # The weights and the K/V are read, not copied: the floor at the read-only rate, for reference.
            "floor_seconds_read_bw": sum(max(m * machine.copy_gbs / max(machine.read_gbs, machine.copy_gbs), c)
                                         for m, c, _ in per),
            "memory_bound_steps": sum(m > c for m, c, _ in per),
            "memory_seconds": sum(m for m, _, _ in per), "compute_seconds": sum(c for _, c, _ in per),
            "gemm_gflops": machine.gflops(shape.dtype), "dtype_bytes": shape.dtype_bytes,
            "table": table,
            "per_step": [{"roofline_ms": 1e3 * max(m, c), "measured_ms": 1e3 * t, "rows": len(s[0]),
                          "bound": "memory" if m > c else "compute"} for s, (m, c, t) in zip(steps, per, strict=True)]}


def from_runs(shape: Shape, machine: Machine, runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Every run that carries its recorded steps ("_steps"), by "system #round". A ceiling run
    replays the steps of the noria-llm run before it: same floor, its replay time as the wall."""
    out = {}
    for system, rows in runs.items():
        for i, row in enumerate(rows):
            if row.get("_steps"):
                a = analyse(shape, machine, row["_steps"], row["seconds"])
                if system == "ceiling":
                    a["forward_seconds"], a["floor_of_forward"] = 0.0, 0.0
                out[f"{system} #{i + 1}"] = a
    return out


def bracketed(shape: Shape, machines: list[Machine], runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Every run that names its bracketing probes ("_probes": indices into `machines`, the probe
    before it and the one after): its floor against the better of those two, by "system #round"."""
    out = {}
    for system, rows in runs.items():
        for i, row in enumerate(rows):
            near = [machines[j] for j in row.get("_probes", []) if 0 <= j < len(machines)]
            if row.get("_steps") and near:
                m = Machine.best(near)
                a = analyse(shape, m, row["_steps"], row["seconds"])
                out[f"{system} #{i + 1}"] = {"copy_gbs": m.copy_gbs, "gemm_gflops": a["gemm_gflops"],
                                             "floor_seconds": a["floor_seconds"], "wall_seconds": a["wall_seconds"],
                                             "floor_of_wall": a["floor_of_wall"]}
    return out


def format_bracketed(b: dict[str, dict]) -> str:
    if not b:
        return ""
    lines = ["", "each run against the best of the two probes that bracket it (the probe before the run and the "
             "one just after):", f"{'run':<18} {'copy GB/s':>10} {'GEMM GFLOP/s':>13} {'floor s':>8} {'wall s':>8} "
             f"{'floor/wall':>11}"]
    lines += [f"{name:<18} {x['copy_gbs']:>10.1f} {x['gemm_gflops']:>13.1f} {x['floor_seconds']:>8.1f} "
              f"{x['wall_seconds']:>8.1f} {x['floor_of_wall']:>11.0%}" for name, x in b.items()]
    return "\n".join(lines)


def format_runs(analyses: dict[str, dict]) -> str:
    """One line per run: its floor against its wall time and its recorded forward time."""
    lines = [f"{'run':<18} {'steps':>6} {'floor s':>8} {'wall s':>8} {'floor/wall':>11} {'forward s':>10} "
             f"{'floor/forward':>14} {'memory-bound steps':>19}"]
    for name, a in analyses.items():
        fwd = (f"{a['forward_seconds']:>10.1f} {a['floor_of_forward']:>14.0%}" if a["forward_seconds"]
               else f"{'-':>10} {'-':>14}")
        lines.append(f"{name:<18} {a['steps']:>6} {a['floor_seconds']:>8.1f} {a['wall_seconds']:>8.1f} "
                     f"{a['floor_of_wall']:>11.0%} {fwd} {a['memory_bound_steps']:>19}")
    return "\n".join(lines)


def format_table(a: dict) -> str:
    head = (f"{'steps':<8} {'rows':>8} {'n':>5} {'tok/step':>9} {'measured ms':>12} {'roofline ms':>12} "
            f"{'memory ms':>10} {'compute ms':>11} {'roof/meas':>10}  bound")
    lines = [head]
    for r in a["table"]:
        lines.append(f"{r['kind']:<8} {r['rows']:>8} {r['steps']:>5} {r['tokens_per_step']:>9.1f} "
                     f"{r['measured_ms']:>12.2f} {r['roofline_ms']:>12.2f} {r['memory_ms']:>10.2f} "
                     f"{r['compute_ms']:>11.2f} {r['roofline_ms'] / r['measured_ms']:>10.0%}  {r['bound']}")
    return "\n".join(lines)


def report(machine: Machine, analyses: dict[str, dict]) -> str:
    """The text `noria bench throughput` prints: the machine, every run, the table of the best noria-llm run."""
    out = ["", "Roofline (physical limit) of each step: max(bytes it must move / copy bandwidth, "
           "FLOPs / GEMM peak);", "summed over the run's steps it is the run's floor (target: floor / wall >= 80%)",
           describe(machine), "", format_runs(analyses)]
    detail = best_run(analyses)
    if detail and machine.read_gbs > machine.copy_gbs:
        a = analyses[detail]
        out.append(f"(at the read-only rate, {machine.read_gbs:.1f} GB/s, {detail}'s floor would be "
                   f"{a['floor_seconds_read_bw']:.1f} s: {a['floor_seconds_read_bw'] / a['wall_seconds']:.0%} "
                   "of its wall time)")
    if detail:
        a = analyses[detail]
        flops = a["compute_seconds"] * a["gemm_gflops"] * 1e9
        at_peak = f", {flops / machine.fma_peak_gflops / 1e9:.1f} s at the theoretical FMA peak" if (
            machine.fma_peak_gflops) else ""
        out.append(f"{detail}: {flops / 1e12:.2f} TFLOP in all: {a['compute_seconds']:.1f} s at the measured "
                   f"GEMM peak{at_peak}; {a['memory_seconds'] * machine.copy_gbs:.0f} GB moved")
        out += ["", f"by row count, {detail} (measured = the worker's recorded forward + logits time per step; "
                "wall time adds scheduling, IPC, sampling):", format_table(analyses[detail])]
    return "\n".join(out)


def best_per_system(analyses: dict[str, dict]) -> dict[str, dict]:
    """The fastest run of each noria system (the ceiling replays a noria-llm run: not a run of its own)."""
    best: dict[str, str] = {}
    for key, a in analyses.items():
        system = key.rsplit(" #", 1)[0]
        if system != "ceiling" and (system not in best or a["wall_seconds"] < analyses[best[system]]["wall_seconds"]):
            best[system] = key
    return {k: analyses[k] for k in best.values()}


def best_run(analyses: dict[str, dict]) -> str | None:
    """The fastest run of the first noria system that ran (noria-llm when it did)."""
    for system in ("noria-llm", "noria-serve", "noria-llm-tp2"):
        mine = {k: a for k, a in analyses.items() if k.rsplit(" #", 1)[0] == system}
        if mine:
            return min(mine, key=lambda k: mine[k]["wall_seconds"])
    return None


def plot(analyses: dict[str, dict], out: Path, machine: str = "") -> None:
    """Measured step time against the step's roofline, log-log, with y = x (the floor)."""
    from noria.bench.plots import pyplot

    plt = pyplot()
    if plt is None or not analyses:
        return
    fig, ax = plt.subplots(figsize=(6.5, 5))
    markers = {"memory": "o", "compute": "^"}
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    lo, hi = float("inf"), 0.0
    for (name, a), color in zip(analyses.items(), colors, strict=False):
        for bound, marker in markers.items():
            pts = [(p["roofline_ms"], p["measured_ms"]) for p in a["per_step"] if p["bound"] == bound]
            if pts:
                ax.scatter(*zip(*pts, strict=True), s=8, alpha=0.5, color=color, marker=marker,
                           label=f"{name}, {bound}-bound ({len(pts)})")
                lo, hi = min(lo, *(min(p) for p in pts)), max(hi, *(max(p) for p in pts))
    if hi > 0:
        ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="y = x (the roofline)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("step roofline, ms")
    ax.set_ylabel("measured forward + logits, ms")
    ax.set_title(f"W1 steps against their roofline\n{machine}", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
