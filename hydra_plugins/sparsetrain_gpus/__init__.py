"""sparsetrain's Hydra launcher, ``hydra/launcher=gpus`` (:mod:`.gpus`). Hydra finds it here; it imports only the
standard library and Hydra, so other Hydra programs in the same environment do not pay for torch."""
