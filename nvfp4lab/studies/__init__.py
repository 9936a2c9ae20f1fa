"""Studies: the logic behind each notebook, with its figures and its ipywidgets explorer.

==================  ==========================================  ============================
module              studies                                     notebook
==================  ==========================================  ============================
``tour``            E2M1 rounding, the E4M3 grid, one block,    ``01_format_tour``
                    the swizzled layout
``bias``            the bias epilogue and the seed's bug        ``02_bias_study``
``throughput``      modeled (roofline) and measured throughput  ``03_throughput``
``formats``         error of every format and NVFP4 option      ``04_formats``
``model_fidelity``  fidelity of a real model (MiniLM), its      ``05_model_study``
                    activations, the calibration text
``model_formats``   MiniLM through every path, format, option   ``05_model_study``
``model_gptq``      GPTQ vs RTN on MiniLM and outlier layers    ``05_model_study``
``llm``             a decoder LLM's next-token fidelity         (a notebook to come)
                    (SmolLM2): perplexity, KL divergence,
                    top-1 agreement, one reference pass
``timeline``        what each vLLM release does with NVFP4,     ``06_vllm_timeline``
                    and the merged fused global scales
``audit``           the checkpoint audit report's table and     ``audit.ipynb`` (package
                    figures (``nvfp4lab audit``)                data, a template)
``explorer``        the plumbing the explorers share
==================  ==========================================  ============================

A new study is one module here (pure functions returning rows, ``plot_*`` functions drawing with
:func:`nvfp4lab.plots.new_figure`, one ``*_explorer``) and one thin notebook that calls it.
"""
