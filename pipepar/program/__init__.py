"""Any ``nn.Module`` as a pipeline: units, the cut of its forward code, drivers and steps."""
