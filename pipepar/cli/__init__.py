"""The ``pipepar`` command: ``profile``, ``plan`` and ``convert`` from the shell.

``pipepar plan MODEL`` plans any model (transformers too) unit by unit, ``pipepar profile
MODEL`` profiles a model and plans its split over devices, ``pipepar convert DIR FILE`` turns a
sharded checkpoint directory into one ``.pt`` file. ``MODEL`` is ``pipepar.zoo:NAME``, a
torchvision model or ``package.module:function`` of your own; ``pipepar --help`` lists the
options.
"""
