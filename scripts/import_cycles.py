#!/usr/bin/env python3
"""File-level import cycles in the Rust sources: pairs of files that each name the other through
crate::, super:: or self:: paths (comments and test modules left out). Exits 1 when any exist.

Usage: scripts/import_cycles.py [SRC_DIR ...]  (default: every crate's src/ and the root src/)"""
import os,re,sys
def modpath(root, f):
    rel=os.path.relpath(f, root)[:-3].split('/')
    if rel[-1] in ('mod','lib','main'): rel=rel[:-1]
    return rel
res=[]
roots = sys.argv[1:] or ["src"] + sorted(os.path.join("crates", c, "src") for c in os.listdir("crates"))
for crate_src in roots:
    files=[os.path.join(d,f) for d,_,fs in os.walk(crate_src) for f in fs if f.endswith('.rs')]
    mods={tuple(modpath(crate_src,f)):f for f in files}
    deps={f:set() for f in files}
    for f in files:
        me=modpath(crate_src,f)
        src=open(f).read()
        src=re.sub(r'//[^\n]*', '', src)
        src=re.sub(r'#\[cfg\(test\)\]\s*mod tests \{.*', '', src, flags=re.S)
        for m in re.finditer(r'\b(crate|super|self)((?:::\w+)+)', src):
            kind=m.group(1); parts=m.group(2).strip(':').split('::')
            if kind=='crate': base=[]
            elif kind=='super': base=me[:-1]
            else: base=list(me)
            path=base+parts
            # longest prefix that is a module
            for k in range(len(path),-1,-1):
                t=tuple(path[:k])
                if t in mods:
                    g=mods[t]
                    if g!=f: deps[f].add(g)
                    break
    for a in files:
        for b in deps[a]:
            if a<b and a in deps[b]:
                res.append((a,b))
for a,b in res: print('CYCLE',a,'<->',b)
print(len(res), "cycles")
sys.exit(1 if res else 0)
