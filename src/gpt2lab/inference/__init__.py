"""Layer 6: running a trained model. ``choice`` (which dtype and kernel, a pure function), ``probe``
(measuring the candidates, for the commands), ``form`` (a model held in the chosen form), ``kernels``
(the decode linears), ``completion`` (text in, text out for sample and serve), ``chat`` (the template a
model is talked to in), ``flags`` (the inference flags every command shares)."""
