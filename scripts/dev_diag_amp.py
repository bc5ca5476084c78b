import copy, os, sys, json, torch, traceback
sys.path.insert(0, "bench")
import graphed, zoo_modern_models
from graphed.train import batch_loss
torch.backends.cuda.matmul.allow_tf32 = False
for name in ["mixtral", "mamba2", "granite_moe_hybrid", "gpt_oss"]:
    for setup in ["amp_bf16", "bf16"]:
        if name != "granite_moe_hybrid" and setup == "bf16": continue
        try:
            entry = zoo_modern_models.build(name, "test", setup)
            model = graphed.auto(copy.deepcopy(entry.model))
            opt = entry.make_optimizer(model)
            for _ in range(6):
                opt.zero_grad()
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=setup == "amp_bf16"):
                    loss = batch_loss(model, None, entry.batch)
                loss.backward(); opt.step()
            st = graphed.auto_stats(model)
            print("DIAG", name, setup, json.dumps({"replays": st["replays"], "captures": st["captures"],
                  "fallbacks": [(f["module"], f["reason"][:1500], f["count"]) for f in st["fallbacks"]][:3],
                  "groups": [str(g)[:800] for g in st.get("training_groups", [])][:2],
                  "modules": {k: v for k, v in list(st["modules"].items())[:3]}}, default=str))
        except Exception:
            traceback.print_exc()
