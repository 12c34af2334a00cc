#!/usr/bin/env python3
# Summarize a SASS source page exported by bench/gpu_ncu.sh (NCU_SOURCE=1):
# stall reasons over the kernel, executed instructions and stall samples by
# opcode, and (with a count N) the N instructions with the most samples.
# Usage: python3 bench/ncu_sass_summary.py ncu_sass_<kernel>.csv [N]
import csv,sys,collections,re
f=sys.argv[1]
rows=list(csv.reader(open(f)))
hdr=rows[1]; data=rows[2:]
ix={h:i for i,h in enumerate(hdr)}
def num(r,k):
    try: return float(r[ix[k]])
    except: return 0.0
tot_s=sum(num(r,"Warp Stall Sampling (All Samples)") for r in data)
tot_e=sum(num(r,"Instructions Executed") for r in data)
print(f, "samples",tot_s,"instr executed",tot_e)
st=[h for h in hdr if h.startswith('stall_') and 'Not Issued' not in h]
agg={h:sum(num(r,h) for r in data) for h in st}
print(' '.join(f"{k[6:]}:{v/tot_s*100:.1f}%" for k,v in sorted(agg.items(),key=lambda x:-x[1]) if v>0))
# samples ncu gives no reason column for (seen on the first HGMMA of a group: the warp waiting for the tensor cores)
print(f"without a listed reason: {(tot_s-sum(agg.values()))/tot_s*100:.1f}%")
ops=collections.Counter(); opss=collections.Counter()
for r in data:
    m=re.match(r'\s*(@!?U?P\w+\s+)?([A-Z0-9_]+)',r[1])
    if m: ops[m.group(2)]+=num(r,"Instructions Executed"); opss[m.group(2)]+=num(r,"Warp Stall Sampling (All Samples)")
print("executed by op:", ' '.join(f"{k}:{v/tot_e*100:.1f}%" for k,v in ops.most_common(25)))
print("samples by op:", ' '.join(f"{k}:{v/tot_s*100:.1f}%" for k,v in opss.most_common(25)))
hm=ops['HMMA']; print("instr per HMMA", tot_e/hm if hm else 0)
if len(sys.argv)>2:
  N=int(sys.argv[2])
  top=sorted(range(len(data)),key=lambda i:-num(data[i],"Warp Stall Sampling (All Samples)"))[:N]
  for i in sorted(top):
    r=data[i]; reasons=sorted(((num(r,h),h[6:]) for h in st),reverse=True)[:3]
    print(f"{i:5d} {num(r,'Warp Stall Sampling (All Samples)'):6.0f} ex={num(r,'Instructions Executed'):9.0f} {r[1].strip()[:60]:60s} {reasons}")
