"""The model's math, torch only: layer builders and shape inference on the meta device, custom
``nn.Module`` factories by import path, losses and accuracy. Knows nothing of distribution."""
