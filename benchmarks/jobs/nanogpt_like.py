"""A training script written the way karpathy/nanoGPT's train.py is: its loop at module level, DDP
built before anything else, gradient accumulation through ``require_backward_grad_sync``, and
rankscope's hook added where a user adds it to such a script, just before the loop.

    RANKSCOPE_SPOOL=/tmp/spool torchrun --nproc-per-node 4 benchmarks/jobs/nanogpt_like.py --seconds 30

Its one fault, for rankscope's fault suite: ``stall`` — from ``--onset-s`` seconds into training,
``--fault-rank`` sleeps ``--fault-ms`` before each backward pass, in the loop's own code (a
blocking call written inline, as such loops have them). With ``--marker-dir`` it writes
``onset-r<rank>`` there (JSON: ``time``, ``step``) at its first faulty step. It takes
``rankscope/demo_job.py``'s command line; flags that are not its own are ignored. At the end rank 0
prints ``train: <steps> steps in <s> s (<ms> ms/step)``, the training loop's time.
"""

import argparse
import gc
import json
import os
import time

import torch
from torch.distributed import all_reduce, destroy_process_group, init_process_group
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from rankscope import profiler_hook
from rankscope.demo_job import GPT

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--seconds", type=float, default=30.0)
ap.add_argument("--fault", choices=("none", "stall"), default="none")
ap.add_argument("--fault-rank", type=int, default=1)
ap.add_argument("--onset-s", type=float, default=10.0)
ap.add_argument("--fault-ms", type=float, default=40.0)
ap.add_argument("--marker-dir", default="")
args, _ = ap.parse_known_args()

batch_size, block_size, vocab_size = 8, 32, 256
gradient_accumulation_steps = 2
learning_rate = 6e-4

init_process_group(backend="gloo")
ddp_rank = int(os.environ["RANK"])
torch.manual_seed(1337 + ddp_rank)
torch.set_num_threads(1)
data = torch.randint(0, vocab_size, (20_000,))


def get_batch(split):
    ix = torch.randint(len(data) - block_size - 1, (batch_size,))
    x = torch.stack([data[i : i + block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
    return x, y


model = GPT(vocab_size, block_size, d_model=64, n_head=4, n_layer=2)
model = DDP(model)  # type: ignore[assignment]  # as nanoGPT writes it
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
hook = profiler_hook.attach()

X, Y = get_batch("train")
iter_num = 0
stalling = False
t0 = time.time()
while True:
    with hook.step(iter_num):
        for micro_step in range(gradient_accumulation_steps):
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1  # type: ignore[assignment]
            logits = model(X)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1))
            loss = loss / gradient_accumulation_steps
            X, Y = get_batch("train")
            if stalling:
                time.sleep(args.fault_ms / 1e3)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    # Rank 0's clock decides when to stop and when the fault begins, on every rank at one step.
    flags = torch.tensor([float(time.time() - t0 >= args.seconds), float(time.time() - t0 >= args.onset_s)])
    if ddp_rank != 0:
        flags.zero_()
    all_reduce(flags)
    if flags[1] and not stalling and args.fault == "stall" and ddp_rank == args.fault_rank:
        stalling = True
        if args.marker_dir:
            with open(os.path.join(args.marker_dir, f"onset-r{ddp_rank}"), "w") as fh:
                json.dump({"time": time.time(), "step": iter_num, "rank": ddp_rank, "kind": "stall"}, fh)
    if flags[0]:
        break
took = time.time() - t0
if ddp_rank == 0:
    print(
        f"train: {iter_num} steps in {took:.2f} s ({1e3 * took / max(iter_num, 1):.2f} ms/step)", flush=True
    )

hook.close()
# The model goes before its process group: a DDP model left to the interpreter's exit frees gloo's
# group during finalization, which can abort the process (pytorch/pytorch#179291). nanoGPT's
# train.py leaves it; seen once here, as "terminate called without an active exception" on exit.
# DDP sits in a reference cycle: only a garbage collection frees it.
del model, optimizer
gc.collect()
destroy_process_group()
