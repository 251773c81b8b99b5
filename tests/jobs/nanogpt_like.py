"""A training script written the way karpathy/nanoGPT's train.py is: its loop at module level, DDP
built before anything else, gradient accumulation through ``require_backward_grad_sync``, and
rankscope's hook added where a user adds it to such a script, just before the loop.

    torchrun --nproc-per-node 2 tests/jobs/nanogpt_like.py SPOOL_DIR MAX_ITERS SLOW_RANK

``SLOW_RANK`` (-1: none) sleeps 40 ms before each backward pass, in the loop's own code.
"""

import os
import sys
import time

import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import profiler_hook
from benchmarks.jobs.lm_ddp import GPT

spool_dir, max_iters, slow_rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
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
model = DDP(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
hook = profiler_hook.attach(job="nanogpt-like", spool_dir=spool_dir)

X, Y = get_batch("train")
iter_num = 0
while True:
    with hook.step(iter_num):
        for micro_step in range(gradient_accumulation_steps):
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            logits = model(X)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1))
            loss = loss / gradient_accumulation_steps
            X, Y = get_batch("train")
            if ddp_rank == slow_rank:
                time.sleep(0.04)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    if iter_num > max_iters:
        break

hook.close()
destroy_process_group()
