"""Time checkpoint.save and checkpoint.verify for GPT-2 124M (weights + AdamW state) on this machine:

    PYTHONPATH=src python benchmarks/checkpoint_cost.py
"""
import os, tempfile, time
import torch
from gpt2lab import checkpoint
from gpt2lab.model import GPT, GPTConfig
from gpt2lab.optim import make_optimizer

model = GPT(GPTConfig(vocab_size=50304))
opt = make_optimizer(model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, device=torch.device("cpu"))
for p in model.parameters():
    p.grad = torch.zeros_like(p)
opt.step()  # AdamW's moments exist
class Counters:  # the trainer part: its step counters
    def state_dict(self): return {"step": 1, "tokens": 0}
    def load_state_dict(self, s): pass
run = tempfile.mkdtemp(dir="/tmp")
for i in range(3):
    t0 = time.perf_counter(); path = checkpoint.save(run, i + 1, {"model": model, "optimizer": opt, "trainer": Counters(), "loader": None, "rng": checkpoint.RNG(), "scaler": None}, {"note": "bench"}, keep=1)
    t1 = time.perf_counter(); checkpoint.verify(path); t2 = time.perf_counter()
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    t3 = time.perf_counter(); [checkpoint.sha256(os.path.join(path, f)) for f in os.listdir(path)]; t4 = time.perf_counter()
    print(f"save {t1-t0:.2f} s, verify {t2-t1:.2f} s (hashing alone {t4-t3:.2f} s), {size/2**30:.2f} GiB")
