"""``brickyard sweep``: hyperparameter search and cross-validation on Optuna (an optional extra, ``brickyard[sweep]``).

- ``space``: the search space, a YAML file over config keys, checked before any trial;
- ``study``: Optuna's study (its storage, sampler and pruner) and what a sweep's answer reads from it;
- ``trial``: one trial, an ordinary run directory, and ``Report``, the callback that tells Optuna its validations.

``brickyard train`` never imports this package.
"""
