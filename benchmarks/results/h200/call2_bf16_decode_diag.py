# throwaway diagnosis: the decode probe's bf16 step on CUDA against generation with the same candidate
import time, torch, sys
sys.path.insert(0, "src")
from gpt2lab import GPT, GPTConfig
from gpt2lab.inference import prepare as P
dev = torch.device("cuda")
torch.manual_seed(0)
m = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257)).to(dev).eval()
req = P.InferenceRequest()
for order in (("bfloat16", "float32"), ("float32", "bfloat16"), ("bfloat16", "float32")):
    for dt in order:
        c = P.Candidate(dt, "plain")
        t = P.measure(m, c, req, dev)
        print("probe", dt, "prefill %.2f step1 %.2f ms" % (t.prefill, t.step1), flush=True)
for dt in ("bfloat16", "float32"):
    pm = P.apply(m, P.Candidate(dt, "plain"))
    cache = pm.new_kv_cache(300)
    with torch.inference_mode():
        pm(torch.randint(0, 50257, (1, 16), device=dev), kv_cache=cache)
        tok = torch.randint(0, 50257, (1, 1), device=dev)
        for k in range(2):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            for _ in range(100):
                pm(tok, kv_cache=cache, last_only=True)
            torch.cuda.synchronize()
            print("loop", dt, "%.2f ms/step" % ((time.perf_counter() - t0) * 10), "cache dtype", cache.__dict__.get("dtype", None) if hasattr(cache, "__dict__") else None, flush=True)
        if k == 1: pass
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        with torch.inference_mode():
            cache = pm.new_kv_cache(64); pm(torch.randint(0, 50257, (1, 16), device=dev), kv_cache=cache)
            for _ in range(5):
                pm(tok, kv_cache=cache, last_only=True)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8), flush=True)
