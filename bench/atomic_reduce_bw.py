"""Float atomic-add bandwidth on the GPU (issue 5: is dQ by atomics in the dK/dV pass worth it?).

Each Triton program adds a BR x 128 float32 tile (values made in registers, no source read) to a
random tile-aligned row block of a float32 destination with relaxed atomics; the same launch with
plain stores is the reference. 1 GiB of additions per case; destinations of 34 MB (fits the H200's
50 MB L2, like case 1's dQ accumulator) and 336 MB (case 2's). CUDA events, median of 10.
Usage (GPU machine, PyTorch with Triton): python3 bench/atomic_reduce_bw.py
Result and conclusion: bench/NOTES-gpu.md (v2.9), log bench/logs/gpu_atomics_h200.txt.
"""
import torch, triton, triton.language as tl
torch.manual_seed(0)
dev='cuda'
@triton.jit
def red(dst, blk, R: tl.constexpr, N: tl.constexpr, BR: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.load(blk + pid)
    r = tl.arange(0, BR)[:, None]; c = tl.arange(0, N)[None, :]
    v = (r * N + c).to(tl.float32) * 1e-3 + pid
    tl.atomic_add(dst + (b * BR + r) * N + c, v, sem='relaxed')
@triton.jit
def st(dst, blk, R: tl.constexpr, N: tl.constexpr, BR: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.load(blk + pid)
    r = tl.arange(0, BR)[:, None]; c = tl.arange(0, N)[None, :]
    v = (r * N + c).to(tl.float32) * 1e-3 + pid
    tl.store(dst + (b * BR + r) * N + c, v)
def t(f, reps=10):
    f(); torch.cuda.synchronize()
    s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True)
    ts=[]
    for _ in range(reps):
        s.record(); f(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts)//2]
for R in (65536, 655360):
  for BR in (32, 64):
    N=128; ntiles = (1<<30)//(BR*N*4)
    dst=torch.zeros(R,N,device=dev)
    blk=torch.randint(0,R//BR,(ntiles,),device=dev,dtype=torch.int32)
    ms=t(lambda: red[(ntiles,)](dst,blk,R,N,BR,num_warps=4))
    ms2=t(lambda: st[(ntiles,)](dst,blk,R,N,BR,num_warps=4))
    print(f"dst {R*N*4/1e6:.0f} MB, tiles of {BR}x128 f32: 1.07 GB of atomic adds {ms:.3f} ms = {1.074/ms:.2f} TB/s; plain stores {ms2:.3f} ms = {1.074/ms2:.2f} TB/s")
