"""How checkpoints sit on storage: tensor files (format), step directories and their
atomic commit (steps), the manifest that names every key (manifest), and retention."""
