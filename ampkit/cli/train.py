"""`ampkit train`: train a reference or user model on shipped, generated or user data."""
from __future__ import annotations

import argparse
import os
import sys

from . import UsageError

_BOOL_FLAGS = {"progress", "compile", "tensorboard", "autotune", "retune", "allow_new_data", "allow_precision_change"}


def add_parser(p: argparse.ArgumentParser) -> None:
    # every default is None: values come from TrainConfig, then --config FILE, then the flags given
    g = p.add_argument_group("what to train")
    g.add_argument("--model", help="cnn | resnet | gpt | mlp | pkg.module:factory (default: the data's model)")
    g.add_argument("--data", help="digits | images | sequences | FILE.npz (x, y arrays) | pkg.module:factory "
                   "(returning datasets or DataLoaders of (x, y) pairs or of dicts for model(**batch))")
    g.add_argument("--config", help="TOML/YAML/JSON file of train options (flags given here override it)")
    g = p.add_argument_group("precision")
    g.add_argument("--precision", help="auto (default) | fp32 | fp16-mixed | bf16-mixed | fp16-master | "
                   "bf16-master | bf16-pure | fp16-pure | fp8-tensorwise | fp8-rowwise | fp8-delayed | mxfp8, "
                   "or an alias (O0-O3, 16-mixed, mixed_bfloat16, ...)")
    g.add_argument("--no-amp", "--unamp", dest="no_amp", action="store_true", default=None,
                   help="train in fp32 (AMP is on by default)")
    g.add_argument("--fp16", action="store_true", default=None,
                   help="apex convention: fp16 model with fp32 master weights (= --precision fp16-master)")
    g.add_argument("--loss-scale", "--loss_scale", dest="loss_scale",
                   help="apex convention: 'dynamic' or 0 = dynamic scaling, a positive number = static scale")
    g.add_argument("--init-scale", type=float, help="initial dynamic loss scale (default 65536)")
    g.add_argument("--fp32-modules", type=lambda s: [x for x in s.split(",") if x],
                   help="comma-separated module names kept in fp32 (e.g. head,blocks.3.attn)")
    _add_fp8_flags(g)
    g.add_argument("--max-consecutive-skips", type=int,
                   help="stop with a report after this many non-finite steps in a row (default 50)")
    g.add_argument("--memory-format", choices=["auto", "channels_last", "contiguous"],
                   help="conv models: auto (default) times both layouts on the first batch and keeps the faster "
                   "(cached per machine); or force one")
    g.add_argument("--no-autotune", dest="autotune", action="store_false", default=None,
                   help="take the defaults instead of timing on this model: the device's default mode for "
                   "precision auto (not the fastest of e.g. bf16-mixed / bf16-master / fp32), the rule for "
                   "the memory format")
    g.add_argument("--retune", action="store_true", default=None,
                   help="measure again what is cached per machine (the 16-bit speed probe, auto's step timings, "
                   "the memory format) instead of reading it: after a hardware, driver or torch change")
    g.add_argument("--compensation", choices=["kahan", "stochastic", "none"],
                   help="bf16-pure only: how updates land in the bf16 weights: kahan (default, a bf16 buffer "
                   "per weight), stochastic (stochastic rounding, no extra state) or none; see docs/BF16_PURE.md")
    g.add_argument("--optimizer-state", choices=["fp32", "bf16", "8bit"],
                   help="precision of the optimizer's moments, any mode: bf16 (4 B/param less for AdamW, "
                   "stochastically rounded) or 8bit (torchao's AdamW8bit); default: the mode's")
    g.add_argument("--eval-precision", choices=["train", "fp32"], help="evaluate in the training precision or with autocast off")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int)
    g.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    g.add_argument("--batch-size", type=_batch_size, help="samples per micro-batch, or auto: the largest that "
                   "`ampkit plan` finds fits the free memory (torchrun: this rank's share) less a 10%% margin (at "
                   "most 4096, and the training set / 16: an epoch keeps 16 optimizer steps)")
    g.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    g.add_argument("--max-norm", type=float, help="clip the gradient norm to this value")
    g.add_argument("--lr", type=float)
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--optimizer", choices=["adamw", "adam", "sgd"])
    g.add_argument("--lr-schedule", choices=["constant", "cosine", "linear"])
    g.add_argument("--warmup-steps", type=int)
    g.add_argument("--seed", type=int)
    g = p.add_argument_group("run")
    g.add_argument("--out", help="run directory (default: runs/<data>-<precision>-<time>)")
    g.add_argument("--resume", help="auto (latest checkpoint in --out) or a checkpoint path")
    _add_resume_flags(g)
    g.add_argument("--save-every", type=int, help="checkpoint every N optimizer steps (default: each epoch)")
    g.add_argument("--keep-last", type=int, help="checkpoints kept (default 3)")
    g.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                   help="no progress bar and no per-step log lines (the per-epoch lines and the report still print)")
    g.add_argument("--log-every", type=int, help="optimizer steps between metric flushes / log lines")
    g.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    g.add_argument("--tensorboard", action="store_true", default=None, help="also write TensorBoard events")
    g.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda if available)")
    g.add_argument("--num-threads", type=int, help="torch CPU threads")
    g.add_argument("--strategy", choices=["ddp", "fsdp"],
                   help="under torchrun: ddp (default) or fsdp (fully_shard with FSDP's mixed precision); "
                   "see docs/DISTRIBUTED.md")


def _batch_size(text: str):
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of samples or auto") from None


def _typed_values(args) -> dict:
    """The options the user actually gave (--config FILE first, flags over it); defaults are not among them."""
    from ..train.config import TrainConfig, load_config_file

    values = dict(load_config_file(args.config)) if args.config else {}
    for name in TrainConfig.field_names():
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
    if args.no_amp and args.fp16:
        raise ValueError("--no-amp and --fp16 contradict each other: pass one.")
    if args.no_amp or args.fp16:
        if args.precision:
            raise ValueError("--precision and --no-amp/--fp16 contradict each other: pass one.")
        values["precision"] = "fp32" if args.no_amp else "fp16-master"
    return values


def _add_resume_flags(g) -> None:
    g.add_argument("--allow-new-data", action="store_true", default=None,
                   help="resuming: continue on data other than the checkpoint's (another size, other samples or "
                   "classes; refused otherwise); recorded in config.toml and metrics.jsonl")
    g.add_argument("--allow-precision-change", action="store_true", default=None,
                   help="resuming: continue in the --precision given instead of the checkpoint's mode (the weights "
                   "carried over; see docs/CHECKPOINTS.md); recorded in config.toml")
    g.add_argument("--precision-change-optimizer", choices=["convert", "reset"],
                   help="with --allow-precision-change: convert the optimizer state (moments cast to the new mode, "
                   "the default) or reset it (a fresh optimizer; the learning-rate schedule continues)")


def _add_fp8_flags(g) -> None:
    g.add_argument("--fp8-filter", choices=["ends", "auto", "all"],
                   help="fp8 modes: which Linears convert: auto (default: dims multiples of 16, not first/last, and "
                   "the per-layer roofline on the target GPU predicts a gain), ends (the same without the roofline), "
                   "all (every layer whose dims fit)")
    g.add_argument("--fp8-gpu", help="fp8 modes: the GPU class --fp8-filter auto judges for (h100, h200, b200, l40s, "
                   "a100, mi300x; default: this GPU's, on a CPU h100, b200 for mxfp8)")
    g.add_argument("--fp8-tokens", type=int, help="fp8 modes: tokens per GEMM of this run (batch x sequence) for "
                   "--fp8-filter auto's roofline (default 8192)")


def _config_from_args(args, announce: bool = False):
    """(the run's TrainConfig, its ResumePlan, whether the batch size is ``auto``): the options given over the
    resumed run's saved ones, and the resume planned once (the checkpoint read at most once, handed on to the
    Trainer). ``--batch-size auto`` is chosen by the planner once the model and data exist (``_auto_batch``)."""
    from ..train.config import TrainConfig
    from ..train.resume import ResumePlan, saved_run_options

    values = _typed_values(args)
    given_out, given = values.get("out"), set(values)
    auto_batch = values.get("batch_size") == "auto"
    if auto_batch:
        del values["batch_size"]
    for k in ("out", "resume", "data", "model", "precision", "device"):
        if isinstance(values.get(k), str) and not values[k].strip():
            raise ValueError(f"--{k} is empty: give a value, or leave the flag out.")

    def note(msg: str) -> None:
        if announce and not env_is_secondary():
            print(f"ampkit train: {msg}", file=sys.stderr)

    plan = ResumePlan(None)
    _, saved = saved_run_options(values, note, plan)
    if values.get("resume") == "auto" and values.get("out") and not saved and not (
            args.config or values.get("data") or values.get("model")):  # nothing says what a new run would train
        out = values["out"]
        what = "does not exist" if not os.path.exists(out) else "holds no checkpoint and no saved config.toml"
        raise ValueError(f"--resume auto: nothing to resume: {out!r} {what}. Check the --out path, or leave "
                         "out --resume to start a new run there (with --data/--model/--config, --resume auto "
                         "starts one when there is nothing to continue).")
    given = set(values)
    if saved:
        changed = {k: (saved[k], v) for k, v in values.items()
                   if k in saved and k not in ("resume", "out") and saved[k] != v}
        added = {k: v for k, v in values.items() if k not in saved and k not in ("resume", "out")}
        if announce and not env_is_secondary():
            parts = [f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()] + [f"{k} -> {v!r}" for k, v in added.items()]
            print(f"ampkit train: resuming {saved.get('out') or values['resume']} with its saved options"
                  + (f"; overridden by what was given here: {', '.join(parts)}" if parts else ""), file=sys.stderr)
        values = {**saved, **values}
        data = values.get("data")
        if ("data" in saved and data == saved["data"] and isinstance(data, str) and data.endswith(".npz")
                and not os.path.isabs(data) and not os.path.exists(data)):
            raise ValueError(f"data file {data!r}, from the run's saved options ({saved.get('out') or 'its checkpoint'}"
                             f"/config.toml), is a path relative to where the run started, and {os.getcwd()!r} "
                             "has no such file: resume from that directory, or pass --data with the file's path.")
        values = _fit_to_launch(values, given, plan, note)
        values = _resume_in_place(values, saved, given, given_out, plan, note)
    data = values.get("data")
    if isinstance(data, str) and data.endswith(".npz") and os.path.isfile(data):
        values["data"] = os.path.abspath(data)  # recorded so: a resume from another directory finds it
    cfg = TrainConfig(**values).checked()  # every range rule lives in TrainConfig.checked
    return cfg, ResumePlan.locate(cfg.resume, cfg.out, plan), auto_batch


def _fit_to_launch(values: dict, given: set, plan, note) -> dict:
    """A resumed run's saved options fitted to this launch's number of processes (``resume.fit_to_world``),
    said once."""
    from ..train.distributed import is_initialized, rank_and_world
    from ..train.resume import ResumePlan, fit_to_world

    if is_initialized():  # a process group of the caller's (library use, tests): its world
        launched, world = True, rank_and_world()[1]
    else:  # torchrun's environment (its group is set up after the options), else one plain process
        launched = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        world = int(os.environ["WORLD_SIZE"]) if launched else 1
    values, said = fit_to_world(values, given, ResumePlan.locate(values.get("resume"), values.get("out"), plan),
                                world, launched)
    if said:
        note(f"resuming on {world} process{'' if world == 1 else 'es'}: {said}")
    return values


def _resume_in_place(values: dict, saved: dict, given: set, given_out, plan, note) -> dict:
    """A resume's options, checked against the run directory it continues: a checkpoint of another run put there
    is refused (naming this run's last good one); an earlier checkpoint of a run that went on trains in a new run
    directory (``--out`` not given: the run untouched); a resumed ``auto`` run keeps asking for auto."""
    from ..train import resume
    from ..train.resume import ResumePlan

    out = values.get("out")
    if out and os.path.isfile(os.path.join(out, "config.toml")):  # a checkpoint of another run put in this one
        located = ResumePlan.locate(values.get("resume"), out, plan)
        ck = located.peek()
        if ck is not None:
            resume.refuse_foreign(located.path, ck, saved, out, given)
    later = resume.later_checkpoints(values.get("resume"), out)
    if later and not given_out:  # an earlier checkpoint of a run that went on: train from it elsewhere
        branch = resume.branch_dir(out, values["resume"])
        note(f"{os.path.basename(values['resume'])} is not the latest checkpoint of {out} (it has "
             f"{', '.join(os.path.basename(p) for p in later)} after it): training from it in a new run directory, "
             f"{branch}; {out} is left as it is (pass --out DIR to choose the directory).")
        values = {**values, "out": branch}
    if "precision" not in given and values.get("precision") not in (None, "auto"):
        # config.toml records the mode auto chose (a reload runs it); a resume keeps asking for auto, which keeps
        # the checkpoint's mode: precision_requested and config.toml's note stay the run's
        ck = ResumePlan.locate(values.get("resume"), values.get("out"), plan).peek()
        if (ck and (ck.get("config") or {}).get("precision") == "auto"
                and (ck.get("precision") or {}).get("name") == values["precision"]):
            values = {**values, "precision": "auto"}
    return values


def run(args) -> int:
    """Under torchrun: set up the process group from its environment first, destroy it at exit. (Warnings
    are one line each, once: `ampkit.cli.one_line_warnings`.) Messages name options as this command's flags."""
    from ..train.wording import cli_wording

    with cli_wording():
        return _run_with_group(args)


def _run_with_group(args) -> int:
    from ..train.distributed import leave_group, process_group_from_env

    try:
        try:
            cfg, plan, auto_batch = _config_from_args(args, announce=True)
            with process_group_from_env(cfg.device) as env:
                code = _run(env, cfg, plan, auto_batch)
                if code == 0:  # every rank finished: leave together (a barrier first)
                    leave_group(env)
                return code
        except ValueError as e:  # bad flags, or the process group could not be set up
            raise UsageError(str(e)) from e
    except UsageError:
        if env_is_secondary():
            return 2  # every rank fails alike on the user's input; rank 0 prints it, once
        raise


def env_is_secondary() -> bool:
    """True on ranks other than 0 of a torchrun launch (they stay quiet)."""
    return int(os.environ.get("RANK", "0")) != 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _run(env, cfg, plan, auto_batch: bool) -> int:
    """One process's training; under torchrun a rank that dies (a signal, an uncaught exception) leaves its last
    stderr lines in ``<out>/ranks/`` (``ampkit.train.rank_log``). A rank that ends as ampkit meant (an exit code,
    a one-line error) leaves nothing."""
    logs: list = []
    try:
        code = _train(env, cfg, plan, auto_batch, logs)
    except UsageError:
        for log in logs:
            log.finished()
        raise
    for log in logs:
        log.finished()
    return code


def _train(env, cfg, plan, auto_batch: bool, logs: list) -> int:
    import torch

    from ..data import load_data
    from ..models import build_model
    from ..precision import NonFiniteGradientsError
    from ..train import CheckpointError, RunDirError, RunDivergedError, Trainer, TrainingInterrupted
    from ..train.rundir import default_run_dir

    try:
        if env is not None and env.device:
            cfg = cfg.updated(device=env.device)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        if cfg.out is None:
            if cfg.resume == "auto":
                raise ValueError("--resume auto needs --out DIR (the run directory to continue).")
            cfg = cfg.updated(out=default_run_dir(cfg.data, cfg.precision) if not env_is_secondary() else None)
            if env is not None:  # every rank uses rank 0's (time-stamped) choice
                from ..train.distributed import broadcast_object

                cfg = cfg.updated(out=broadcast_object(cfg.out))
        if env is not None:
            from ..train.rank_log import rank_log

            logs.extend(filter(None, [rank_log(cfg.out, env.rank, env.world_size)]))
        data = load_data(cfg.data, seed=cfg.seed)
        torch.manual_seed(cfg.seed)
        if not (cfg.model or data.default_model):
            raise ValueError(f"--data {cfg.data} yields dict samples (keyword inputs, Hugging Face style): pass the "
                             "model for them with --model pkg.module:factory.")
        model = build_model(cfg.model or data.default_model, **data.model_kwargs)
        choice = _auto_batch(cfg, model, data) if auto_batch else None
        if choice is not None:
            cfg = cfg.updated(batch_size=choice.batch_size)
        trainer = Trainer(model, data.train, data.test, config=cfg, task=data.task, class_names=data.class_names,
                          resume_plan=plan, planned_peak_bytes=choice.peak_bytes if choice is not None else None)
        summary = trainer.fit()
    except TrainingInterrupted as e:
        if not env_is_secondary():
            print(f"ampkit train: {e}", file=sys.stderr)
        return 128 + int(e.signum)
    except RunDivergedError as e:  # trained to its end, written as it is (summary.json says "diverged")
        if not env_is_secondary():
            print(f"ampkit train: error: {e} (run directory {cfg.out})", file=sys.stderr)
        return 3
    except NonFiniteGradientsError as e:
        if not env_is_secondary():
            print(f"ampkit train: error: training stopped: {e} {LOWER_LR}", file=sys.stderr)
        return 3
    except (ValueError, CheckpointError, RunDirError, FileNotFoundError) as e:
        raise UsageError(str(e)) from e
    except OSError as e:  # a full disk, a read-only or vanished directory: the environment, not a bug
        where = f" ({e.filename})" if e.filename else ""
        raise UsageError(f"{e.strerror or e}{where}; checkpoints already written are intact: fix the cause, "
                         "then continue with --resume auto.") from e
    if not env_is_secondary():
        print(f"ampkit train: run directory {trainer.run_dir}", file=sys.stderr)
    return 0


#: after a divergence stop: how to continue with a lower learning rate (``--lr`` applies on that resume)
LOWER_LR = ("To continue with a lower learning rate: the same command with --resume auto --lr LOWER (it applies "
            "from the last checkpoint on, recorded in config.toml and metrics.jsonl).")


def _auto_batch(cfg, model, data):
    """``--batch-size auto``: ``ampkit.plan``'s largest batch for this model, data and mode; says why, once.

    Under torchrun the batch is per rank, planned for one rank of the run's strategy against this rank's
    share of the memory; rank 0's answer is every rank's."""
    from ..cli.plan import sample_batch
    from ..memory import auto_batch_size
    from ..train.distributed import broadcast_object, rank_and_world, run_device

    _, world = rank_and_world()
    # the largest batch that fits, but never so large that an epoch is a step or two: one batch of the whole
    # training set takes one optimizer step an epoch, and trains little at the default learning rate
    # (under torchrun every rank takes its batch from the same epoch)
    per_epoch = max(1, len(data.train) // (MIN_STEPS_PER_EPOCH * cfg.grad_accum * world))
    cap = min(4096, per_epoch)
    choice = auto_batch_size(model, sample_batch(data, 2), precision=cfg.precision, optimizer=cfg.optimizer,
                             device=run_device(cfg.device), cap=cap, world_size=world,
                             strategy=cfg.strategy if world > 1 else None)
    choice = broadcast_object(choice)
    if not env_is_secondary():
        ranks = f" x {world} ranks" if world > 1 else ""
        why = (f" (capped at the training set's {len(data.train)} samples / {MIN_STEPS_PER_EPOCH} optimizer steps "
               f"an epoch{ranks}; memory would allow more: pass a number to train with larger batches)"
               if choice.batch_size == cap == per_epoch else "")
        print(f"ampkit train: --batch-size auto -> {choice.batch_size}: {choice.reason}{why}", file=sys.stderr)
    return choice


#: ``--batch-size auto`` keeps at least this many optimizer steps in an epoch
MIN_STEPS_PER_EPOCH = 16
