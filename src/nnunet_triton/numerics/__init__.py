"""nnU-Net's inference numerics as pure ``xp`` array functions (NumPy on CPU, CuPy on GPU).

No Triton, no client, no build code: this package imports only the standard library, NumPy/SciPy
(CuPy lazily through ``_xp``) and the core modules (``errors``, ``io_names``, ``options``, ``dtypes``);
``tests/unit/test_layering.py`` guards it.

* ``plans`` -- the typed view of plans.json + dataset.json (``InferenceConfig``); ``model_folder`` reads it
  from a trained results folder
* ``preprocess``, ``cropping``, ``normalization``, ``resampling``, ``cascade`` -- nnU-Net's preprocessor
* ``tiling``, ``gaussian``, ``sliding_window`` -- the tile grid, the importance map, the splitter + merger
* ``prediction_export``, ``postprocessing``, ``ensembling`` -- logits to the label map in input space
* ``limits`` -- the voxel and memory limits a request is checked against
"""
