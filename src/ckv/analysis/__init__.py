"""Mechanistic analyses of trained models: knock-outs, gate concentration, gate cycling and the joint view.

They build on evaluation (the same prompts and statistics) and install their own hooks on the model; model code
carries no analysis state."""
