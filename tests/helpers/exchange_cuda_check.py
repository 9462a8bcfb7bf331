"""The overlapped exchange on CUDA tensors: two gloo processes on one GPU, against ``PowerSGD.reduce``.

Run by ``tests/test_exchange_cuda.py`` (``cuda`` marker: skipped without a GPU; on CPU it runs the same check
on the CPU). Three SGD steps of a tiny embedding + residual model, each through the overlapped exchange and
through the end-of-backward path, must land on the same weights within 1e-5.
"""
import tempfile
import torch, torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
DEV = "cuda" if torch.cuda.is_available() else "cpu"

def model():
    torch.manual_seed(0)
    m = nn.Sequential()
    m.add_module("embed", nn.Embedding(50, 16))
    for i in range(3):
        m.add_module(f"block{i}", nn.Linear(16, 16))
    m.add_module("head", nn.Linear(16, 50))
    return m.to(DEV)

def run(rank, world, path, out):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    from dalle_lightning_plugins.compression.exchange import OverlappedExchange
    from dalle_lightning_plugins.compression.powersgd import PowerSGD
    from dalle_lightning_plugins.compression.inter_node import embedding_param_names
    results = {}
    for overlap in (True, False):
        m = model()
        ps = PowerSGD(None, rank=2, min_compression=0.0, dense_with_p=True)
        ex = OverlappedExchange(ps, dist.new_group([0, 1]), dist.new_group([0, 1]), bucket_cap_mb=0.0)
        ex.attach(m, [f"block{i}" for i in range(3)], embedding_param_names(m), embedding_param_names(m))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for step in range(3):
            tokens = torch.randint(0, 50, (4, 6), generator=g).to(DEV)
            x = m.embed(tokens)
            for i in range(3):
                x = x + torch.tanh(getattr(m, f"block{i}")(x))
            loss = nn.functional.cross_entropy(m.head(x).reshape(-1, 50), tokens.reshape(-1))
            opt.zero_grad()
            ex.begin(active=overlap)
            loss.backward()
            if overlap:
                ok = ex.finish()
            else:
                ok = ps.reduce([(n, p.grad) for n, p in m.named_parameters()], uncompressed=embedding_param_names(m))
            assert ok
            opt.step()
        torch.cuda.synchronize() if DEV == "cuda" else None
        results[overlap] = {n: p.detach().cpu() for n, p in m.named_parameters()}
        results[f"bytes_{overlap}"] = ps.stats.bytes_sent_last_step
    worst = max(float((results[True][n] - results[False][n]).abs().max()) for n in results[True])
    print(f"rank {rank}: device {torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu'}, worst |overlap - end| = {worst:.2e}, bytes {results['bytes_True']} vs {results['bytes_False']}", flush=True)
    assert worst < 1e-5, worst
    dist.destroy_process_group()

if __name__ == "__main__":
    path = tempfile.mktemp()
    mp.spawn(run, args=(2, path, None), nprocs=2)
    print("CUDA exchange check passed")
