"""gpu-check's comparison on models nobody here wrote: Hugging Face ``LlamaForCausalLM`` and ``GPT2LMHeadModel`` built
from configs (random init, SDPA attention), each ampkit mode against what a user would write instead.

Rows (one fresh model each, the same seed and batch): the plain fp32 loop; ``torch.autocast`` bf16 (torch's
default AdamW, then fused AdamW); plain pure bf16 (``model.to(bf16)`` + fused AdamW); accelerate bf16 and
Lightning Fabric bf16-mixed where importable; every ampkit mode (fp8 modes convert every Linear/Conv1D:
``fp8_filter="all"``). :func:`compiled_rows`: ``torch.compile(model)`` in bf16 (autocast + fused AdamW), torchao's
float8 (``convert_to_float8_training``) and ampkit fp8-tensorwise. Per row: ms/step (median of synchronised
steps after warm-up), MFU (6 x params x tokens per step over the measured bf16 GEMM peak), peak GiB
(``max_memory_allocated``: CUDA only), host syncs in one step (``torch.cuda.set_sync_debug_mode("warn")``: CUDA
only). Rows are appended to ``rows`` as they finish, so a part stopped at its time budget keeps what it measured.
"""
from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from typing import Callable, Dict, List, Optional

import torch

#: model sizes: on a GPU those of the H200 run of 2026-11-28 (Llama 0.54B, GPT-2 124M, batch 8 x 1024); the CPU smoke's tiny
SIZES = {
    "gpu": {"llama": dict(hidden_size=2048, num_hidden_layers=8, intermediate_size=5632, vocab_size=32000,
                          num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=1024),
            "gpt2": dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),
            "batch": (8, 1024), "warmup": 2, "steps": 5,
            # the compiled row: fewer layers, so three inductor compiles fit one part's budget
            "compiled_layers": 2},
    "cpu": {"llama": dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, vocab_size=64,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32),
            "gpt2": dict(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32),
            "batch": (2, 16), "warmup": 1, "steps": 1, "compiled_layers": 1},
}
#: the CPU smoke's rows (every kind of runner once, each model; in seconds): the GPU runs them all
SMOKE = {"llama": {"plain fp32", "autocast bf16", "pure bf16 + fused AdamW", "accelerate bf16", "Fabric bf16-mixed",
                   "ampkit bf16-mixed", "ampkit bf16-master", "ampkit bf16-pure", "ampkit fp8-tensorwise"},
         "gpt2": {"autocast bf16", "ampkit bf16-mixed", "ampkit fp8-delayed"}}
PEERS = ["plain fp32", "autocast bf16", "autocast bf16 + fused AdamW", "pure bf16 + fused AdamW",
         "torch-optimi Kahan AdamW bf16", "torchao _AdamW bf16 stochastic rounding", "accelerate bf16", "Fabric bf16-mixed"]


def build(arch: str, size: dict, layers: Optional[int] = None):
    import transformers as T

    torch.manual_seed(0)
    if arch == "llama":
        kw = dict(size["llama"], **({"num_hidden_layers": layers} if layers else {}))
        cfg = T.LlamaConfig(**kw, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = T.LlamaForCausalLM(cfg)
    else:
        kw = dict(size["gpt2"], **({"n_layer": layers} if layers else {}))
        model = T.GPT2LMHeadModel(T.GPT2Config(**kw, bos_token_id=0, eos_token_id=0))
    model.config._attn_implementation = "sdpa"
    model.loss_type = "ForCausalLM"
    return model


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


#: where set (a list), each step appends the seconds its update took (the optimizer's step and zero_grad, after
#: backward; the device synced on both sides): bf16_pure_peers.py reports them beside the whole step
UPDATES: Optional[List[float]] = None


@contextlib.contextmanager
def _update(device):
    """The step's update (the optimizer step and zero_grad), timed into :data:`UPDATES` where that is set."""
    if UPDATES is None:
        yield
        return
    _sync(device)
    t0 = time.perf_counter()
    yield
    _sync(device)
    UPDATES.append(time.perf_counter() - t0)


class Runner:
    """One row: ``prepare(model) -> (model, optimizer, step)``; ``step(batch)`` runs forward, backward and the
    optimizer step."""

    def __init__(self, name: str, prepare: Callable):
        self.name, self.prepare = name, prepare


def _plain(device, cast=None, autocast=False, fused=False):
    def prepare(model):
        model = model.to(device)
        if cast is not None:
            model = model.to(cast)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if fused else {}))
        ctx = (lambda: torch.autocast(device.type, torch.bfloat16)) if autocast else contextlib.nullcontext
        return model, _loop_step(model, opt, ctx)
    return prepare


def _loop_step(forward, opt, ctx):
    """The hand-written loop's step: ``forward`` (the model, or its compiled callable) inside ``ctx()``, the
    loss's backward, the optimizer's step."""
    def step(batch):
        with ctx():
            loss = forward(**batch).loss
        loss.backward()
        with _update(loss.device):
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


def _engine_step(model, opt, backward):
    """A peer engine's training step: its own backward (accelerate's, Fabric's), then the optimizer's step."""
    def step(batch):
        backward(model(**batch).loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _pure_peer(device, which):
    """A bf16 model (``model.to(bf16)``) with a peer's compensated AdamW: torch-optimi's ``AdamW(kahan_sum=True)``
    (a bf16 Kahan buffer, as ampkit's default) or torchao's ``_AdamW(bf16_stochastic_round=True)``; torch's
    defaults otherwise (lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.01)."""
    def prepare(model):
        model = model.to(device).to(torch.bfloat16)
        if which == "optimi":
            import optimi

            opt = optimi.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                               kahan_sum=True)
        else:
            from torchao.optim import _AdamW

            opt = _AdamW(model.parameters(), lr=1e-4, bf16_stochastic_round=True)
        return model, _loop_step(model, opt, contextlib.nullcontext)
    return prepare


def _accelerate(device):
    def prepare(model):
        from accelerate import Accelerator

        acc = Accelerator(mixed_precision="bf16", cpu=device.type == "cpu")
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        return model, _engine_step(model, opt, acc.backward)
    return prepare


def _fabric(device):
    def prepare(model):
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator=device.type, devices=1, precision="bf16-mixed")
        model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        return model, _engine_step(model, opt, fabric.backward)
    return prepare


def _ampkit(device, mode, compile_backend=None, **options):
    """An ampkit row: ``Precision(mode, device, **options)`` set up on the model and torch's AdamW."""
    def prepare(model):
        import ampkit
        from ampkit.precision.modes import MODES

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prec = ampkit.Precision(mode, device, **({"fp8_filter": "all"} if MODES[mode].fp8 else {}), **options)
            model, opt = prec.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        fwd = torch.compile(model, backend=compile_backend) if compile_backend else model

        def step(batch):
            with prec.autocast():
                loss = fwd(**batch).loss
            prec.backward(loss)
            with _update(loss.device):
                prec.step(opt)
                opt.zero_grad(set_to_none=True)
        return model, step
    return prepare


def _compiled_plain(device, backend, torchao_fp8=False):
    def prepare(model):
        model = model.to(device)
        if torchao_fp8:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            emulate = not (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9))
            convert_to_float8_training(model, config=Float8LinearConfig(emulate=emulate))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        fwd = torch.compile(model, backend=backend)
        return model, _loop_step(fwd, opt, lambda: torch.autocast(device.type, torch.bfloat16))
    return prepare


def eager_runners(device) -> List[Runner]:
    from ampkit.precision.modes import MODES

    rows = [Runner("plain fp32", _plain(device)),
            Runner("autocast bf16", _plain(device, autocast=True)),
            Runner("autocast bf16 + fused AdamW", _plain(device, autocast=True, fused=True)),
            Runner("pure bf16 + fused AdamW", _plain(device, cast=torch.bfloat16, fused=True)),
            Runner("torch-optimi Kahan AdamW bf16", _pure_peer(device, "optimi")),
            Runner("torchao _AdamW bf16 stochastic rounding", _pure_peer(device, "torchao")),
            Runner("accelerate bf16", _accelerate(device)),
            Runner("Fabric bf16-mixed", _fabric(device))]
    return rows + [Runner(f"ampkit {m}", _ampkit(device, m)) for m in MODES]


def compiled_runners(device, backend) -> List[Runner]:
    return [Runner(f"compiled autocast bf16 ({backend})", _compiled_plain(device, backend)),
            Runner(f"compiled torchao fp8 ({backend})", _compiled_plain(device, backend, torchao_fp8=True)),
            Runner(f"compiled ampkit fp8-tensorwise ({backend})", _ampkit(device, "fp8-tensorwise", backend))]


def bf16_peak(device) -> float:
    """FLOP/s of a bf16 GEMM on ``device`` (ampkit.bench's measure: what torch gets here, not a datasheet)."""
    from ampkit.bench.peak import measure_gemm

    return measure_gemm(device, torch.bfloat16, 8192 if device.type == "cuda" else 128, budget_s=0.5, max_reps=5)


def run_row(runner: Runner, arch: str, device, size: dict, peak: float, layers: Optional[int] = None) -> Dict:
    """One row's numbers, or ``{"name", "error"}`` where the runner cannot run here."""
    row = {"name": runner.name, "arch": arch if layers is None else f"{arch} ({layers} layers)"}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        model = build(arch, size, layers)
        params = sum(p.numel() for p in model.parameters())
        b, t = size["batch"]
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (b, t), generator=g).to(device)
        batch = {"input_ids": ids, "labels": ids}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, step = runner.prepare(model)
            for _ in range(size["warmup"]):
                step(batch)
            times = []
            for _ in range(size["steps"]):
                _sync(device)
                t0 = time.perf_counter()
                step(batch)
                _sync(device)
                times.append(time.perf_counter() - t0)
        ms = 1e3 * statistics.median(times)
        row.update(ms=ms, params=params, mfu=6 * params * b * t / (ms / 1e3) / peak if peak else None)
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    step(batch)
                    torch.cuda.current_stream(device).synchronize()  # explicit: sync debug mode flags implicit ones only
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            row["syncs"] = sum("synchroniz" in str(w.message) for w in caught)
        del model, step
    except Exception as e:  # noqa: BLE001 - a peer not installed, a mode this device refuses: the row says so
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return row


def table(rows: List[Dict], ref: str = "autocast bf16") -> str:
    """The markdown table of ``rows`` (``vs autocast``: the ``ref`` row's ms over the row's, same model)."""
    lines = ["| model | row | ms/step | vs autocast bf16 (compiled: vs compiled) | MFU | peak GiB | host syncs |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['arch']} | {r['name']} | - | - | - | - | {r['error']} |")
            continue
        compiled = r["name"].startswith("compiled")  # against compiled bf16; eager rows against eager autocast
        base = next((x["ms"] for x in rows if x["arch"] == r["arch"] and "ms" in x and
                     (x["name"].startswith("compiled " + ref) if compiled else x["name"] == ref)), None)
        vs = f"{base / r['ms']:.2f}x" if base else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        gib = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "n/a"
        syncs = str(r["syncs"]) if "syncs" in r else "n/a"
        lines.append(f"| {r['arch']} | {r['name']} | {r['ms']:.1f} | {vs} | {mfu} | {gib} | {syncs} |")
    return "\n".join(lines)


def summary(rows: List[Dict]) -> str:
    done = [r for r in rows if "ms" in r]
    failed = [f"{r['name']} ({r['error']})" for r in rows if "error" in r]
    return (f"{len(done)} rows measured (table below)" + (f"; could not run: {'; '.join(failed)}" if failed else ""))


def compare(arch: str, device, rows: List[Dict], compiled: bool = False) -> str:
    """Append the rows of ``arch`` (eager, or the compiled three) to ``rows``; the part's one-line result."""
    device = torch.device(device)
    size = SIZES["cpu" if device.type == "cpu" else "gpu"]
    peak = bf16_peak(device)
    if compiled:  # the CPU smoke traces with dynamo only (inductor's C++ build takes minutes there)
        runners, layers = compiled_runners(device, "eager" if device.type == "cpu" else "inductor"), size["compiled_layers"]
    else:
        runners, layers = eager_runners(device), None
    if device.type == "cpu" and not compiled:
        runners = [r for r in runners if r.name in SMOKE[arch]]
    mine = []
    for r in runners:
        row = run_row(r, arch, device, size, peak, layers)
        rows.append(row)
        mine.append(row)
    return summary(mine)
