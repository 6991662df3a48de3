"""sbpbench: exact StreamBP and a benchmark of backpropagation methods on long sequences.

Layer map: each package's job, then after "->" the packages of ours it may import besides itself.
tests/unit/test_layers.py reads the map from this docstring and fails on any other import of ours, at
module or function level or by a string (a loader's argument, a preload list), on an arrow no
import uses, on any import cycle between modules, and on a name imported from a package that only
passes it on from another (import it from the package that defines it). A module that needs a
back-edge is in the wrong package. Any module may import this root module (it runs before any of them anyway);
`sbpbench` here is the root itself and __main__.py.

    settings: every setting a user can give (type, default, check, help, flag, which methods read it), ConfigError; torch-free -> nothing
    core: exact StreamBP (layer-wise backward, chunked LM head, objectives) -> nothing
    measure: memory, time and FLOPs of a step, and the environment it ran in -> nothing
    records: the results schema, its CSV files, and reading their rows (select.py) -> measure, settings
    models: named model shapes (shipped configs), local checkpoints and Hub ids, building them, LoRA -> core, settings
    data: synthetic batches per objective (of core: objective types, label constants) -> core, settings
    methods: the compared methods by name, the training step, exactness checks -> core, data, settings
    config: a point as a value (RunSpec, MaxlenSpec: made, checked and resolved once), experiment files -> settings, methods, models, measure, core, data
    workload: what a spec builds (model, batch, training step) and its row's key and provenance, for runner and simulate -> config, methods, models, data, measure, records
    runner: points measured in own processes, sweeps, max-T search, timeouts, what a sweep costs -> workload, config, methods, measure, records, models, core, simulate, settings
    simulate: peak memory predicted under fake tensors -> workload, config, methods, measure, records, models, data, core, settings
    report: the results table beside the paper's numbers, as Markdown -> records, measure
    plot: figures of a results table -> records, measure, settings
    cli: the `sbp` commands (each imports torch's side inside its function) -> settings, config, runner, simulate, report, plot, records, measure, models
    integrations: StreamBP trainers for transformers and TRL (nothing of ours imports it but tests) -> core
    sbpbench: the version, this map, `python -m sbpbench` -> cli
"""

__version__ = "0.1.0"
