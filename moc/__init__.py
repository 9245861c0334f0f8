"""moc: cheap fault tolerance for Mixture-of-Experts training in PyTorch."""

__version__ = "0.1.0"
