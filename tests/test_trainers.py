"""onebit inside the real Hugging Face Trainer and the real Lightning Trainer, on 2 gloo ranks:
the docs pages' complete scripts run as written (short runs; bench/bench_trainers.py runs them
at full length for the quality numbers), resume from the Trainer's own checkpoint is exact, and
accumulation, torch.compile and a second train() keep working."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from importlib.util import find_spec

import pytest
from helpers import ROOT
from zygote import launch

# found, not imported: collecting this file in every pytest process would cost Lightning's import
# (4 s); the launched scripts import both
if find_spec("transformers") is None or find_spec("pytorch_lightning") is None:
    pytest.skip("needs transformers and pytorch_lightning", allow_module_level=True)


def page_script(page: str) -> str:
    """The last ```python block of a docs page: its complete script."""
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / page).read_text(), flags=re.S)[-1]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.pop("TRITON_INTERPRET", None)
    return env


def run_script(tmp_path, code: str, *args: str, launcher: str = "zygote", name: str = "script.py"):
    """Run ``code`` on 2 ranks: started as torchrun starts them (``zygote``: forked from a process
    that imported the frameworks once, tests/zygote.py; ``torchrun``: torchrun itself), or by the
    script itself (``python``: Lightning's and Fabric's own launcher). Returns its result line as
    a dict, and stderr."""
    script = tmp_path / name
    script.write_text(code)
    if launcher == "python":
        run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                             timeout=600, env=_env(), cwd=tmp_path)
    else:
        run = launch(script, *args, nproc=2, cwd=tmp_path, env=_env(), real=launcher == "torchrun")
    assert run.returncode == 0, run.stderr[-4000:]
    (tmp_path / "last_stdout.txt").write_text(run.stdout)
    # rank 0 prints it (the script compared the ranks' weights with an all-gather)
    found = re.findall(r"^(\w+) (\S+) replicas identical (\w+) bytes_compressed (\d+) weights (\w+)$",
                       run.stdout, flags=re.M)
    assert len(found) == 1, run.stdout[-3000:] + run.stderr[-3000:]
    _, loss, same, sent, weights = found[0]
    return dict(loss=float(loss), same=same == "True", sent=int(sent), weights=weights), run.stderr


FOREIGN = "loaded an optimizer state saved by another rank"
# the pages' scripts evaluate 200,000 held-out bytes (25 batches of 64 windows): 200 windows here, a
# third of a short run's time
HELD_OUT = ("--held-out", "25600")


def _last_stdout(tmp_path) -> str:
    return (tmp_path / "last_stdout.txt").read_text()


def test_hf_trainer_onebit_adam_resumes_exactly_from_its_own_checkpoint(tmp_path):
    # the Trainer's default clipping (max_grad_norm=1.0) is on; freeze at 6 of 20 steps
    code = page_script("hf-trainer.md")
    common = ("--optimizer", "onebit-adam", "--steps", "20", "--freeze-step", "6", "--save-steps", "10",
              *HELD_OUT)
    whole, err = run_script(tmp_path, code, *common, "--output-dir", "whole")
    assert whole["same"] and whole["sent"] > 0 and whole["loss"] < 4.0, whole  # ln 256 = 5.55 untrained
    assert (tmp_path / "whole/checkpoint-10/onebit/step000000010/rank00001.pt").is_file()
    # resume from the Trainer's checkpoint at step 10: bitwise the uninterrupted run, and no rank
    # loaded another rank's error buffers (the Trainer loads rank 0's optimizer.pt everywhere;
    # onebit's per-rank files replace it)
    for name in ("resumed", "without"):
        shutil.copytree(tmp_path / "whole/checkpoint-10", tmp_path / name / "checkpoint-10")
    shutil.rmtree(tmp_path / "without/checkpoint-10/onebit")
    resumed, err = run_script(tmp_path, code, *common, "--output-dir", "resumed", "--resume")
    assert resumed["weights"] == whole["weights"], (resumed, whole)
    assert resumed["sent"] == whole["sent"]
    assert FOREIGN not in err and "no directory among" not in err, err[-3000:]
    # the control: without onebit's files the resume is not exact, and says so
    without, err = run_script(tmp_path, code, *common, "--output-dir", "without", "--resume")
    assert without["weights"] != whole["weights"]
    assert "no directory among" in err, err[-3000:]


def test_hf_trainer_adamw_gets_the_compression_hook(tmp_path):
    # freeze_step 4 (a quarter), 12 compressed steps
    got, _ = run_script(tmp_path, page_script("hf-trainer.md"), *HELD_OUT, "--optimizer", "adamw",
                        "--steps", "16", "--save-steps", "1000")
    assert got["same"] and got["sent"] > 0 and got["loss"] < 4.0, got  # ln 256 = 5.55 untrained


@pytest.mark.parametrize("half", [6, 3])
def test_hf_trainer_muon_with_adamw_as_one_optimizer_gets_the_hook_and_resumes_exactly(tmp_path, half):
    # onebit.optimizers.Combined([muon, adamw]) through the Trainer's optimizers=: the hook compresses
    # Muon's gradient from iteration 2 and AdamW's half by freeze_step (a quarter of the run: 3); the
    # Trainer's optimizer.pt (the members' states, the schedule's rates) and onebit's per-rank files
    # resume it bitwise, from after the freeze (6) or from its eve (3: Muon's early errors saved with a
    # bucket that also holds AdamW's parameters seed that bucket's error at the freeze)
    code = page_script("hf-trainer.md")
    common = ("--optimizer", "muon", "--steps", "12", "--save-steps", str(half), *HELD_OUT)
    whole, _ = run_script(tmp_path, code, *common, "--output-dir", "whole")
    assert whole["same"] and whole["sent"] > 0 and whole["loss"] < 4.5, whole  # ln 256 = 5.55 untrained
    shutil.copytree(tmp_path / f"whole/checkpoint-{half}", tmp_path / "resumed" / f"checkpoint-{half}")
    resumed, err = run_script(tmp_path, code, *common, "--output-dir", "resumed", "--resume")
    assert resumed["weights"] == whole["weights"], (resumed, whole)
    assert FOREIGN not in err and "no directory among" not in err, err[-3000:]


def test_hf_trainer_adamw_behind_the_hook_resumes_exactly_on_the_freezes_eve(tmp_path):
    # AdamW behind the hook, freeze_step a quarter of 12 (3), resumed from checkpoint-3: the first
    # compressed iteration runs on the fresh DDP's first bucket layout, which the hook sends as the
    # buckets of the run before the checkpoint (the state's plan): bitwise the uninterrupted run
    code = page_script("hf-trainer.md")
    common = ("--optimizer", "adamw", "--steps", "12", "--save-steps", "3", *HELD_OUT)
    whole, _ = run_script(tmp_path, code, *common, "--output-dir", "whole")
    assert whole["same"] and whole["sent"] > 0, whole
    shutil.copytree(tmp_path / "whole/checkpoint-3", tmp_path / "resumed" / "checkpoint-3")
    resumed, err = run_script(tmp_path, code, *common, "--output-dir", "resumed", "--resume")
    assert resumed["weights"] == whole["weights"], (resumed, whole)


ACCUMULATE = """
import torch, torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from onebit import OnebitAdam
from onebit.integrations.transformers import attach
import gc, sys
which, compile_ = sys.argv[1], sys.argv[2] == "compile"
torch.manual_seed(0)
data = torch.randint(0, 64, (512, 32), generator=torch.Generator().manual_seed(0))
train = [{"input_ids": x, "labels": x} for x in data]
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
args = TrainingArguments("out", use_cpu=True, ddp_backend="gloo", ddp_find_unused_parameters=False,
                         max_steps=6, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         report_to="none", save_strategy="no", disable_tqdm=True, torch_compile=compile_,
                         torch_compile_backend="eager")
opt = (OnebitAdam, {"lr": 1e-3, "freeze_step": 2}) if which == "onebit" else (torch.optim.AdamW, {"lr": 1e-3})
trainer = Trainer(model=model, args=args, train_dataset=train, optimizer_cls_and_kwargs=opt)
cb = attach(trainer, block=32)
trainer.train()
trainer.train()  # a second call: the same DDP, its hook kept
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
every = [torch.empty_like(flat) for _ in range(2)]
dist.all_gather(every, flat)
if which == "onebit":
    s = trainer.optimizer.optimizer.stats()
    assert s["stage"] == "compression" and s["bytes_compressed"] > 0, s
else:
    s = cb.session.hook_state.stats()
    # two train() calls of 6 steps: 12 hook iterations (one per optimizer step, not per micro-batch)
    assert s["iter"] == 12 and s["bytes_compressed"] > 0 and cb.session.hook_state.block == 32, s
if dist.get_rank() == 0:
    print("loss 0.0 replicas identical", torch.equal(every[0], every[1]), "bytes_compressed",
          s["bytes_compressed"], "weights x")
del trainer, model, cb; gc.collect()  # first what holds the group: torch 2.13's gloo can abort at exit
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("which,mode", [("adamw", "compile"), ("onebit", "plain")])
def test_hf_trainer_accumulation_compile_and_a_second_train(tmp_path, which, mode):
    got, _ = run_script(tmp_path, textwrap.dedent(ACCUMULATE), which, mode)
    assert got["same"] and got["sent"] > 0


@pytest.mark.parametrize("optimizer", ["onebit-adam", "adamw", "muon"])
def test_lightning_trains_with_the_callback_on_cpu(tmp_path, optimizer):
    # AdamW as the page says to run it (Lightning starts the second rank itself); OnebitAdam, and
    # Muon + AdamW as one Combined optimizer from configure_optimizers, on ranks started as torchrun
    # starts them (Lightning then takes the ranks it is given)
    got, _ = run_script(tmp_path, page_script("lightning.md"), *HELD_OUT, "--optimizer", optimizer,
                        "--steps", "20", "--freeze-step", "6",
                        launcher="python" if optimizer == "adamw" else "zygote")
    assert got["same"] and got["sent"] > 0 and got["loss"] < 4.0, got  # ln 256 = 5.55 untrained


LIGHTNING_RESUME = """
import gc, glob, hashlib, sys
import pytorch_lightning as L
import torch, torch.distributed as dist
from onebit import OnebitAdam
from onebit.integrations.lightning import OnebitCallback


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return OnebitAdam(self.parameters(), lr=1e-2, freeze_step=3, bias_correction=True)


class Probe(L.Callback):
    # after OnebitCallback restored the state: does each rank hold its OWN saved error buffers?

    def on_train_start(self, trainer, pl_module):
        r = dist.get_rank()
        live = trainer.optimizers[0].state_dict()["onebit"]["worker_errors"]
        own = torch.load(f"{sys.argv[1]}/onebit/step000000006/rank{r:05d}.pt")["state"]["optimizer"]
        other = torch.load(f"{sys.argv[1]}/onebit/step000000006/rank{1 - r:05d}.pt")["state"]["optimizer"]
        mine = all(torch.equal(a, b) for a, b in zip(live, own["onebit"]["worker_errors"], strict=True))
        theirs = all(torch.equal(a, b) for a, b in zip(live, other["onebit"]["worker_errors"], strict=True))
        flags = torch.tensor([int(mine and not theirs)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        if r == 0:
            print("own error buffers on every rank", bool(flags))


g = torch.Generator().manual_seed(0)
x = torch.randn(6 * 2 * 8, 16, generator=g)
data = torch.utils.data.TensorDataset(x, x[:, :4].argmax(1))
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)  # 6 steps per epoch and rank
torch.manual_seed(0)
module = Net()
ckpt = L.callbacks.ModelCheckpoint(dirpath=sys.argv[1], every_n_epochs=1, save_top_k=-1)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=12, gradient_clip_val=0.5,
                    callbacks=[ckpt, OnebitCallback()] + ([Probe()] if sys.argv[2] == "probe" else []),
                    enable_progress_bar=False, logger=False)
resume = sorted(glob.glob(sys.argv[1] + "/*step=6.ckpt"))[0] if sys.argv[2] != "fresh" else None
trainer.fit(module, loader, ckpt_path=resume)
flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
every = [torch.empty_like(flat) for _ in range(2)]
dist.all_gather(every, flat)
s = trainer.optimizers[0].stats()
if dist.get_rank() == 0:
    print("loss 0.0 replicas identical", torch.equal(every[0], every[1]), "bytes_compressed",
          s["bytes_compressed"], "weights", hashlib.sha1(flat.numpy().tobytes()).hexdigest()[:16])
del trainer, module; gc.collect()  # first what holds the group: torch 2.13's gloo can abort at exit
dist.barrier()
dist.destroy_process_group()
"""


def test_lightning_resume_gives_each_rank_its_own_state(tmp_path):
    # Lightning's own resume is not bitwise here (plain Adam without onebit ends elsewhere too),
    # so this checks what onebit adds: each rank's error buffers are its own after fit(ckpt_path=)
    code = textwrap.dedent(LIGHTNING_RESUME)
    whole, _ = run_script(tmp_path, code, "ckpt", "fresh")
    assert whole["same"] and whole["sent"] > 0
    assert (tmp_path / "ckpt/onebit/step000000006/rank00001.pt").is_file()
    resumed, err = run_script(tmp_path, code, "ckpt", "probe")
    assert resumed["same"] and resumed["sent"] == whole["sent"], (resumed, whole)
    assert "own error buffers on every rank True" in err + _last_stdout(tmp_path), err[-3000:]
    assert FOREIGN not in err and "no directory among" not in err, err[-3000:]
    shutil.rmtree(tmp_path / "ckpt/onebit")  # the control: Lightning's rank-0 state alone
    without, err = run_script(tmp_path, code, "ckpt", "resume")
    assert "no directory among" in err and FOREIGN in err, err[-3000:]


BACKBONE_FINETUNING = """
import gc, glob, hashlib, json, sys
import pytorch_lightning as L
import torch, torch.distributed as dist
from pytorch_lightning.callbacks import BackboneFinetuning
from onebit import OnebitAdam
from onebit.integrations.lightning import OnebitCallback


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU())
        self.head = torch.nn.Linear(32, 4)

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        params = filter(lambda p: p.requires_grad, self.parameters())
        if sys.argv[1] == "adamw":
            return torch.optim.AdamW(params, lr=1e-2)
        return OnebitAdam(params, lr=1e-2, freeze_step=3)


g = torch.Generator().manual_seed(0)
x = torch.randn(6 * 2 * 8, 16, generator=g)
data = torch.utils.data.TensorDataset(x, x[:, :4].argmax(1))
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)  # 6 steps per epoch and rank
torch.manual_seed(0)
module = Net()
start = [p.detach().clone() for p in module.backbone.parameters()]
# the backbone frozen until epoch 1, then added with add_param_group (Lightning's BaseFinetuning)
finetune = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.1, verbose=False)
onebit = [] if sys.argv[1] == "adamw" else [OnebitCallback()]
saving = sys.argv[2:] != []  # a checkpoint per epoch into sys.argv[2]; sys.argv[3] "resume": from step 18
ckpt = [L.callbacks.ModelCheckpoint(dirpath=sys.argv[2], every_n_epochs=1, save_top_k=-1)] if saving else []
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=4,
                    callbacks=[finetune] + onebit + ckpt, enable_progress_bar=False, logger=False,
                    enable_checkpointing=saving)
resume = sorted(glob.glob(sys.argv[2] + "/*step=18.ckpt"))[0] if sys.argv[3:] == ["resume"] else None
trainer.fit(module, loader, ckpt_path=resume)
flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
every = [torch.empty_like(flat) for _ in range(2)]
dist.all_gather(every, flat)
opt = trainer.optimizers[0]
s = opt.stats() if sys.argv[1] != "adamw" else {"bytes_compressed": 0}
moved = min(float((p.detach() - p0).abs().max()) for p, p0 in zip(module.backbone.parameters(), start))
if dist.get_rank() == 0:
    print("cohorts", json.dumps(s.get("cohorts")), "moved", moved, "groups", len(opt.param_groups))
    print("loss 0.0 replicas identical", torch.equal(every[0], every[1]), "bytes_compressed",
          s["bytes_compressed"], "weights", hashlib.sha1(flat.numpy().tobytes()).hexdigest()[:16])
del trainer, module; gc.collect()  # first what holds the group: torch 2.13's gloo can abort at exit
dist.barrier()
dist.destroy_process_group()
"""


def test_lightning_backbone_finetuning_adds_a_group_mid_run(tmp_path):
    # Lightning's progressive unfreezing calls add_param_group at epoch 1 (step 6): the backbone becomes a
    # cohort with its own warm-up (3 updates) and compression (issue 58). DDP was built while the backbone
    # was frozen, so DDP never averages its gradients: the cohort averages its own warm-up and compresses
    # after, and the replicas stay identical; AdamW under the same script ends with different replicas
    code = textwrap.dedent(BACKBONE_FINETUNING)
    got, _ = run_script(tmp_path, code, "onebit")
    out = _last_stdout(tmp_path)
    (cohorts,) = re.findall(r"^cohorts (.*) moved (\S+) groups (\d+)$", out, flags=re.M)
    (cohort,) = json.loads(cohorts[0])
    assert got["same"] and got["sent"] > 0 and float(cohorts[1]) > 1e-3 and cohorts[2] == "2"
    assert cohort["joined_at"] == 6 and cohort["updates"] == 18 and cohort["stage"] == "compression"
    control, _ = run_script(tmp_path, code, "adamw")
    assert not control["same"]  # the check can fail: torch's AdamW replicas drift apart here


def test_lightning_backbone_finetuning_resumes_with_its_cohort(tmp_path):
    # a checkpoint at step 18 (the backbone's cohort 12 updates in, compressing): the resumed fit rebuilds the
    # cohort from Lightning's checkpoint and each rank's onebit state (its own error buffers), ends with the
    # cohort's count of the uninterrupted run and identical replicas (Lightning's own resume is not bitwise)
    code = textwrap.dedent(BACKBONE_FINETUNING)
    whole, _ = run_script(tmp_path, code, "onebit", str(tmp_path / "ckpt"))
    resumed, err = run_script(tmp_path, code, "onebit", str(tmp_path / "ckpt"), "resume")
    (cohorts,) = re.findall(r"^cohorts (.*) moved (\S+) groups (\d+)$", _last_stdout(tmp_path), flags=re.M)
    (cohort,) = json.loads(cohorts[0])
    assert resumed["same"] and resumed["sent"] == whole["sent"], (resumed, whole)
    assert cohort["joined_at"] == 6 and cohort["updates"] == 18 and cohort["stage"] == "compression"
    assert FOREIGN not in err, err[-3000:]


TINY_GPT2 = """
torch.manual_seed(0)
data = torch.randint(0, 64, (512, 32), generator=torch.Generator().manual_seed(0))
train = [{"input_ids": x, "labels": x} for x in data]
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
"""  # a 1-layer GPT-2 on random tokens (the clip scripts' model)

CLIP_AND_SKIP = """
import gc, json, math
import torch, torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from onebit import OnebitAdam
from onebit.integrations.transformers import attach


class Poison(TrainerCallback):
    # a non-finite gradient on rank 1 only, at the 6th optimizer step
    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if state.global_step == 5 and dist.get_rank() == 1:
            next(model.parameters()).grad.view(-1)[0] = math.nan


""" + TINY_GPT2 + """
args = TrainingArguments("out", use_cpu=True, ddp_backend="gloo", ddp_find_unused_parameters=False,
                         max_steps=8, per_device_train_batch_size=4, max_grad_norm=0.05, logging_steps=1,
                         report_to="none", save_strategy="no", disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[Poison()],
                  optimizer_cls_and_kwargs=(OnebitAdam, {"lr": 1e-3, "freeze_step": 2}))
attach(trainer)
trainer.train()
opt = trainer.optimizer.optimizer
norms = [row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row]
every = [None, None]
dist.all_gather_object(every, norms)
if dist.get_rank() == 0:
    print(json.dumps(dict(norms=every, skipped=opt.skipped_steps, updates=opt.updates,
                          scheduler=trainer.lr_scheduler.last_epoch, max_grad_norm=args.max_grad_norm)))
del trainer, model, opt; gc.collect()
dist.barrier()
dist.destroy_process_group()
"""


def _norms_of(tmp_path, name: str, text: str) -> dict:
    """Run a two-rank script that prints one JSON line starting with {"norms"; that line, read."""
    script = tmp_path / name
    script.write_text(textwrap.dedent(text))
    run = launch(script, nproc=2, cwd=tmp_path, env=_env())
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads([line for line in run.stdout.splitlines() if line.startswith("{\"norms\"")][0])


def test_hf_trainer_clips_by_the_agreed_norm_and_a_skipped_step_holds_the_schedule(tmp_path):
    got = _norms_of(tmp_path, "clip.py", CLIP_AND_SKIP)
    norms = got["norms"]
    assert len(norms[0]) == 8 and all(n > 0.05 for n in norms[0][:5]), norms  # the clip was active
    # torch's clip on local gradients logs each rank's own norm after the freeze (step 3 on)
    assert norms[0][:5] == norms[1][:5], norms
    assert got["skipped"] == 1 and got["updates"] == 7, got  # rank 1's NaN skipped step 6 everywhere
    assert got["scheduler"] == 7, got  # 8 optimizer calls, one skipped: the schedule moved 7 times
    assert got["max_grad_norm"] == 0.05  # the Trainer's setting is back after train()


SGD_CLIP = """
import gc, json
import torch, torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from onebit.integrations.transformers import attach


class Handed(TrainerCallback):
    # before onebit's callback: the norm of the gradient the hook handed over, and the Trainer's setting
    def __init__(self):
        self.norms, self.settings = [], []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
        self.norms.append(float(torch.cat(grads).double().norm()))
        self.settings.append(args.max_grad_norm)


""" + TINY_GPT2 + """
args = TrainingArguments("out", use_cpu=True, ddp_backend="gloo", ddp_find_unused_parameters=False,
                         max_steps=8, per_device_train_batch_size=4, max_grad_norm=1e6, logging_steps=1,
                         report_to="none", save_strategy="no", disable_tqdm=True, seed=0)
handed = Handed()
trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[handed],
                  optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}))
attach(trainer)
trainer.train()
norms = [row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row]
every = [None, None]
dist.all_gather_object(every, norms)
if dist.get_rank() == 0:
    print(json.dumps(dict(norms=every, handed=handed.norms, settings=handed.settings,
                          max_grad_norm=args.max_grad_norm)))
del trainer, model; gc.collect()
dist.barrier()
dist.destroy_process_group()
"""


def test_hf_trainer_clips_an_sgd_behind_the_hook_by_the_agreed_norm(tmp_path):
    # issue 59, session 45: behind the hook without freeze_step (an SGD's momentum, a Muon's gradient) the
    # gradient handed over from start_iter (2) is the compressed average, whose 1-bit noise torch's norm
    # reads (here 1.4-2.6x the estimate); the Trainer's clip becomes the agreed estimate of the mean
    # gradient's norm there too (before, only an Adam-type's after its freeze did)
    got = _norms_of(tmp_path, "sgd_clip.py", SGD_CLIP)
    norms, handed = got["norms"], got["handed"]
    assert len(norms[0]) == 8 and norms[0] == norms[1], norms  # logged every step, the same on both ranks
    assert got["settings"] == [0.0] * 8 and got["max_grad_norm"] == 1e6, got  # taken over, then put back
    for t, (norm, own) in enumerate(zip(norms[0], handed, strict=True)):
        if t < 2:  # full precision: torch's norm of the averaged gradient
            assert norm == pytest.approx(own, rel=1e-5), (t, norm, own)
        else:  # compressed: the estimate, well under the norm of the 1-bit average handed over
            assert norm < own / 1.2, (t, norm, own)


def test_agreed_scaler_keeps_torchs_settings_and_scale():
    import torch

    from onebit.integrations._session import agreed_scaler
    from onebit.optimizers import GradScaler

    torch_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=3.0, backoff_factor=0.25,
                                        growth_interval=7)
    agreed = agreed_scaler(torch_scaler)
    assert isinstance(agreed, GradScaler)
    assert agreed.state_dict() == torch_scaler.state_dict()
    assert agreed.get_scale() == torch_scaler.get_scale() == 1024.0


LOOPS = """
import gc, sys
import torch, torch.distributed as dist
from onebit import OnebitAdam
from onebit.integrations import attach

framework, which = sys.argv[1], sys.argv[2]
if framework == "accelerate":
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)  # the process group exists from here on
else:
    import lightning_fabric as L
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = (OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3, bias_correction=True) if which == "onebit"
       else torch.optim.AdamW(model.parameters(), lr=1e-2))
if framework == "accelerate":
    model, opt = acc.prepare(model, opt)
    backward, rank = acc.backward, acc.process_index
else:
    model, opt = fabric.setup(model, opt)
    backward, rank = fabric.backward, fabric.global_rank
session = attach(model, opt, block=32)
for t in range(12):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * t + rank))
    backward(torch.nn.functional.cross_entropy(model(x), x[:, :4].argmax(1)))
    norm = session.clip(0.5)
    opt.step()
    opt.zero_grad()
every = [None, None]
dist.all_gather_object(every, (float(norm), [p.detach().clone() for p in model.parameters()]))
same = every[0][0] == every[1][0] and all(torch.equal(a, b) for a, b in zip(every[0][1], every[1][1]))
session.save("state", 12)
sent = (session.optimizer.stats() if which == "onebit" else session.hook_state.stats())["bytes_compressed"]
if rank == 0:
    print("loss 0.0 replicas identical", same, "bytes_compressed", sent, "weights x")
del model, opt, session; gc.collect()
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("framework,which", [("accelerate", "adamw"), ("accelerate", "onebit"),
                                             ("fabric", "onebit")])
def test_loops_around_accelerate_and_fabric(tmp_path, framework, which):
    code = textwrap.dedent(LOOPS)
    launcher = "zygote" if framework == "accelerate" else "python"  # Fabric starts its own ranks
    got, _ = run_script(tmp_path, code, framework, which, launcher=launcher)
    assert got["same"] and got["sent"] > 0, got
    assert (tmp_path / "state/step000000012/rank00001.pt").is_file()


SCALER = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from onebit.integrations.transformers import attach
from onebit.optimizers import GradScaler

model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
trainer = Trainer(model=model, args=TrainingArguments("out", use_cpu=True, report_to="none"))
# what Accelerate makes for fp16 on CUDA (on CPU it makes none): torch's scaler, local overflow check
trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=5)
attach(trainer)
scaler = trainer.accelerator.scaler
assert isinstance(scaler, GradScaler) and scaler.get_scale() == 512.0, scaler
assert scaler.get_growth_interval() == 5
print("scaler replaced")
"""


def test_attach_replaces_accelerates_local_scaler(tmp_path):
    script = tmp_path / "scaler.py"
    script.write_text(textwrap.dedent(SCALER))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env=_env(), cwd=tmp_path)
    assert run.returncode == 0 and "scaler replaced" in run.stdout, run.stderr[-3000:]
