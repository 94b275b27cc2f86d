"""The "Mixed precision" tab of TensorBoard: a TensorBoard plugin shipped with tfmixprec.

Outside the `tfmixprec` package, as the command's `_tfmixprec_args` is: TensorBoard loads it
through the `tensorboard_plugins` entry point in its own process, where importing `tfmixprec`
would import TensorFlow and Keras (seconds) for a page that only reads logs. `names` holds the
tags and event kinds that `tfmixprec.TensorBoard` writes and the plugin reads (one place for
both sides); `plugin` is the plugin (reading the logs through TensorBoard's data provider);
`static/` the page's script and styles, served by the plugin (nothing fetched from the
network).
"""
