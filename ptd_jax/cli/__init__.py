"""The command-line tools, each a thin layer of flags over the library (console scripts in pyproject.toml).

train.py       ptd-train: Megatron's flags -> configs -> `train.loop.train`
preprocess.py  ptd-preprocess: text -> a Megatron .bin/.idx pair
schedule.py    ptd-schedule: print, check and plot a pipeline schedule table
plan.py        ptd-plan: the performance model's predictions and layout search
generate.py    ptd-generate: sampling from a checkpoint
convert.py     ptd-convert: Hugging Face GPT-2 <-> checkpoints
launch.py      ptd-launch: N local processes of one multi-process run
args.py        what the tools share: one-line argparse errors, checked number types, tokenizer flags
errors.py      where every tool turns a failure into its one line and exit code (2 input, 1 run-time)
precision.py   ptd-train's precision flags (--bf16, --fp16 and the loss scaler, --max-skipped-iters)
"""
