"""The planner: from a VRAM budget to the fastest memory plan that fits, and its corrections at run time.

Other trainers answer "will it fit?" with fixed tiers (a table of `blocks_to_swap` values per card
size) that users then run out of memory with. Here the answer is computed: a memory model predicts
the peak VRAM and host RAM of every candidate plan, a timing model predicts its step time, and the
search keeps the fastest plan whose peak plus a safety margin is under the budget. At run time the
first training steps check the prediction and correct it, and an out-of-memory re-plans tighter.

The package imports nothing on its own (callers import the module they need), and the memory
engine (leantune/memory/) never imports it: the engine applies a `leantune.memory.plan.Plan`, the
planner chooses one.

Prediction (nothing here knows about a running trainer):
  workload.py          Workload, Budget, InfeasibleBudget: the inputs, and "nothing fits them"
  machine.py           the GPU's and the host's rates and sizes (measured, or assumed without a GPU)
  meta.py              full-size architectures on the meta device (build_meta_flux)
  weight_bytes.py      exact weight, fp8 and packed-unit bytes per block; adapter shapes
  activation_probe.py  activations and FLOPs traced on a meta copy (imports peft and the engine)
  activations.py       ActivationProfile and its composition over the whole stack (light)
  spec_cache.py        MeasuredModel: what the planner measures of a model, kept on disk per source
                       and workload shape, so the next plan builds nothing and traces nothing
  kept_files.py        the kept answers, measurements and calibrations read as untrusted input:
                       a file of the wrong shape is ignored (and said), never a traceback
  host_model.py        host RAM while loading, while memory is applied, and during the steps
  timing.py            step time: compute plus the copies the ring cannot hide
  corrections.py       Calibration (measured corrections the model applies) and its CalibrationStore
  memory_model.py      MemoryModel: all of the above for one plan, per component
  search.py            Planner: the search over plans, and why a budget is infeasible
  report.py            format_plan: the plan and its breakdown as a table
  from_config.py       entry points for a run: workload_from_config, budget_from_config,
                       planner_for_config, choose_plan, plan_for_config, plan_memory, parse_vram

Runtime feedback (feedback/; depends on the prediction, never the other way round):
  feedback/oom.py        OomGuard, NoPlanFits: the one owner of the run's plan and budget; re-plans
                         tighter and redoes a step after a CUDA out-of-memory (applying included)
  feedback/calibrate.py  PlanCalibrator: the first steps' measured peaks correct the model and
                         re-plan once, through the guard, within the budget in use
"""
