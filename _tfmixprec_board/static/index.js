// The "Mixed precision" tab of TensorBoard (tfmixprec): the loss scale with every overflow
// step marked, the loss on the same step axis, each layer's overflow steps over time, the
// events (diagnoses, repairs, min_scale overflows, OverflowGuard stops) and float8's
// saturation, per run and for several runs side by side. It draws what the plugin's /data
// route serves (the logs read through TensorBoard's data provider); nothing is fetched from
// anywhere else. Axes fit the data: nothing is clipped as an outlier.

const SVG = 'http://www.w3.org/2000/svg';
const WIDTH = 760;
const MARGIN = {left: 64, right: 16, top: 12, bottom: 34};
const MAX_SELECTED = 6;
const AXIS_NAMES = {
  step: 'step (0-based, skipped steps counted)',
  batch: "Keras's batch (1-based)",
  epoch: 'epoch',
};
const EVENT_NAMES = {
  diagnosis: 'diagnosis',
  repair: 'repair',
  min_scale: 'overflow at min_scale',
  guard_stop: 'OverflowGuard stop',
};

export async function render() {
  const style = el('link', {rel: 'stylesheet', href: 'static/style.css'});
  document.head.appendChild(style);
  const root = el('main', {class: 'tfmixprec'});
  document.body.appendChild(root);
  root.appendChild(el('h1', {}, 'Mixed precision'));
  root.appendChild(
    el(
      'p',
      {class: 'lede'},
      'The loss scale and every overflow step, why a step overflowed and what was ' +
        'repaired, as tfmixprec recorded them during fit.',
    ),
  );
  let runs;
  try {
    runs = (await getJson('runs')).runs;
  } catch (error) {
    root.appendChild(el('p', {class: 'error'}, `Could not read the runs: ${error}`));
    document.body.dataset.rendered = '0';
    return;
  }
  if (!runs.length) {
    root.appendChild(
      el('p', {class: 'empty'}, 'No run holds what tfmixprec.TensorBoard writes yet.'),
    );
    document.body.dataset.rendered = '0';
    return;
  }
  const picker = el('fieldset', {class: 'runs'}, el('legend', {}, 'Runs'));
  const panels = el('div', {class: 'panels'});
  root.appendChild(picker);
  root.appendChild(panels);
  const chosen = new Set(runs.slice(0, MAX_SELECTED));
  for (const run of runs) {
    const box = el('input', {type: 'checkbox', value: run});
    box.checked = chosen.has(run);
    box.addEventListener('change', () => {
      box.checked ? chosen.add(run) : chosen.delete(run);
      drawRuns(panels, runs.filter((r) => chosen.has(r)));
    });
    picker.appendChild(el('label', {}, box, ` ${run}`));
  }
  await drawRuns(panels, runs.filter((r) => chosen.has(r)));
}

async function drawRuns(panels, runs) {
  panels.textContent = '';
  panels.className = `panels count-${Math.min(runs.length, 2)}`;
  for (const run of runs) {
    const panel = el('section', {class: 'run', 'data-run': run}, el('h2', {}, run));
    panels.appendChild(panel);
    try {
      const data = await getJson(`data?run=${encodeURIComponent(run)}`);
      drawRun(panel, data);
    } catch (error) {
      panel.appendChild(el('p', {class: 'error'}, `Could not read run ${run}: ${error}`));
    }
  }
  document.body.dataset.rendered = String(runs.length);
}

function drawRun(panel, data) {
  const domain = stepDomain(data);
  panel.appendChild(summary(data));
  if (data.scale.length || data.overflows.length) {
    const chart = scaleChart(data, domain);
    panel.appendChild(figure('Loss scale (log2), each overflow step marked', chart, 'scale'));
  } else {
    const why = 'No loss scaling in this run: its optimizer does not scale the loss (bfloat16 and float32 need none).';
    panel.appendChild(el('p', {class: 'empty no-scaling'}, why));
  }
  if (data.loss.length) {
    const loss = lineChart(domain, [{points: data.loss, cls: 'loss'}], {});
    panel.appendChild(figure('Loss', loss, 'loss'));
  }
  if (data.layers.length) {
    panel.appendChild(figure('Overflow steps per layer (most first)', heatMap(data, domain), 'layers'));
  }
  panel.appendChild(eventTable(data));
  for (const chart of float8Charts(data, domain)) panel.appendChild(chart);
}

function summary(data) {
  const overflows = data.overflow_total ?? data.overflows.reduce((n, [, c]) => n + c, 0);
  const last = data.scale.length ? data.scale[data.scale.length - 1] : null;
  const taken = last ? last[0] + (data.axis === 'step' ? 1 : 0) : null;
  const repairs = data.events.filter((e) => e.kind === 'repair');
  const parts = [];
  if (data.axis === 'step' && taken !== null) {
    parts.push(`${taken} steps: ${taken - overflows} applied, ${overflows} skipped (overflow)`);
  } else {
    parts.push(`${overflows} overflow steps (skipped)`);
  }
  if (last) parts.push(`loss scale now ${formatScale(last[1])}`);
  parts.push(`${repairs.length} repair${repairs.length === 1 ? '' : 's'}`);
  const start = data.starts.length ? data.starts[data.starts.length - 1] : null;
  if (start) parts.push(`policy ${start.policy}`);
  if (data.source === 'keras') parts.push("from Keras's TensorBoard callback beside LossScaleMonitor");
  const line = el('p', {class: 'summary'}, parts.join(' · '));
  line.dataset.overflowSteps = String(overflows);
  return line;
}

function stepDomain(data) {
  const steps = [];
  for (const key of ['scale', 'loss', 'overflows']) for (const [s] of data[key]) steps.push(s);
  for (const event of data.events) steps.push(event.step);
  if (!steps.length) return [0, 1];
  const low = Math.min(...steps);
  const high = Math.max(...steps);
  return low === high ? [low - 0.5, high + 0.5] : [low, high];
}

function scaleChart(data, domain) {
  const log2 = data.scale.filter(([, v]) => v > 0).map(([s, v]) => [s, Math.log2(v)]);
  const marks = data.overflows.map(([step, count]) => [step, count, scaleBefore(log2, step)]);
  const values = log2.map(([, v]) => v).concat(marks.map(([, , v]) => v));
  const low = values.length ? Math.floor(Math.min(...values)) : 0;
  const high = values.length ? Math.ceil(Math.max(...values)) : 1;
  const yDomain = [low - 0.5, Math.max(high, low + 1) + 0.5];
  const svg = lineChart(domain, [{points: log2, cls: 'scale', stepped: true}], {
    yDomain,
    yTicks: integerTicks(yDomain),
    yFormat: (v) => `2^${v}`,
  });
  const {x, y} = svg.scales;
  for (const event of data.events.filter((e) => e.kind === 'repair')) {
    const at = x(event.step);
    svg.appendChild(
      el(
        'line',
        {class: 'repair-mark', x1: at, x2: at, y1: MARGIN.top, y2: svg.plotBottom},
        el('title', {}, `repair at step ${event.step}: ${event.layers.join(', ')} now float32`),
      ),
    );
  }
  for (const [step, count, level] of marks) {
    const said = count === 1 ? `overflow at step ${step}` : `${count} overflow steps, the last at step ${step}`;
    svg.appendChild(
      el(
        'circle',
        {
          class: 'overflow-marker',
          cx: x(step),
          cy: y(level),
          r: count === 1 ? 4 : 4 + Math.min(6, Math.log2(count)),
          'data-step': step,
          'data-count': count,
        },
        el('title', {}, said),
      ),
    );
  }
  if (!marks.length) svg.appendChild(note(svg, 'no overflow step'));
  return svg;
}

function scaleBefore(log2, step) {
  // The level an overflow backed off from: the scale written before its step.
  let level = log2.length ? log2[0][1] : 0;
  for (const [s, v] of log2) {
    if (s >= step) break;
    level = v;
  }
  return level;
}

function heatMap(data, domain) {
  const columns = Math.min(120, Math.max(1, Math.ceil(domain[1] - domain[0]) + 1));
  const rowHeight = 18;
  const height = MARGIN.top + data.layers.length * rowHeight + MARGIN.bottom;
  const svg = el('svg', {class: 'heatmap', width: WIDTH, height, viewBox: `0 0 ${WIDTH} ${height}`});
  const left = 200;
  const cell = (WIDTH - left - MARGIN.right) / columns;
  const bin = (step) =>
    Math.min(columns - 1, Math.floor(((step - domain[0]) / (domain[1] - domain[0] || 1)) * columns));
  let most = 0;
  const rows = data.layers.map((layer) => {
    const counts = new Array(columns).fill(0);
    let before = 0;
    for (const [step, total] of layer.points) {
      counts[bin(step)] += Math.max(0, total - before);
      before = total;
    }
    most = Math.max(most, ...counts);
    return counts;
  });
  data.layers.forEach((layer, i) => {
    const top = MARGIN.top + i * rowHeight;
    svg.appendChild(
      el('text', {class: 'layer-name', x: left - 8, y: top + rowHeight * 0.7, 'text-anchor': 'end'}, `${shorten(layer.name, 26)} (${layer.total})`),
    );
    rows[i].forEach((count, c) => {
      if (!count) return;
      svg.appendChild(
        el(
          'rect',
          {
            class: 'heat',
            x: left + c * cell,
            y: top + 2,
            width: Math.max(cell - 0.5, 1),
            height: rowHeight - 4,
            'fill-opacity': 0.25 + 0.75 * (count / most),
          },
          el('title', {}, `${layer.name}: ${count} overflow step(s)`),
        ),
      );
    });
  });
  const bottom = MARGIN.top + data.layers.length * rowHeight;
  const x = (v) => left + ((v - domain[0]) / (domain[1] - domain[0] || 1)) * (WIDTH - left - MARGIN.right);
  drawXAxis(svg, x, domain, bottom, data.axis);
  return svg;
}

function eventTable(data) {
  const wrap = el('div', {class: 'events'}, el('h3', {}, 'Events'));
  if (!data.events.length) {
    const why =
      data.source === 'keras'
        ? "Keras's own TensorBoard callback records no diagnosis or repair: use tfmixprec.TensorBoard for them."
        : 'No diagnosis, repair, min_scale overflow or OverflowGuard stop in this run.';
    wrap.appendChild(el('p', {class: 'empty'}, why));
    return wrap;
  }
  const table = el('table', {}, el('tr', {}, ...['step', 'event', 'layer', 'cause', 'what'].map((h) => el('th', {}, h))));
  for (const event of data.events) {
    const [layer, cause, what] = describe(event);
    table.appendChild(
      el(
        'tr',
        {class: `event ${event.kind}`, 'data-kind': event.kind, 'data-step': event.step},
        el('td', {}, String(event.step)),
        el('td', {}, EVENT_NAMES[event.kind] || event.kind),
        el('td', {class: 'layer'}, layer),
        el('td', {class: 'cause'}, cause),
        el('td', {class: 'what'}, what),
      ),
    );
  }
  wrap.appendChild(table);
  return wrap;
}

function describe(event) {
  if (event.kind === 'diagnosis') {
    let what = event.message;
    if (typeof event.value === 'number' && event.value > 65504 && !what.includes('65504')) {
      what = `a value of ${formatNumber(event.value)} (in float32) passed float16's 65504. ${what}`;
    }
    return [event.layer || '', event.cause, what];
  }
  if (event.kind === 'repair') {
    const moved = event.layers.concat(event.float32_loss ? ['the loss'] : []);
    let what = `moved to float32: ${moved.join(', ')}`;
    if (event.loss_scale) what += `; loss scale restarted at ${formatScale(event.loss_scale)}`;
    return [event.layers.join(', '), event.cause, what];
  }
  return ['', '', event.message || ''];
}

function float8Charts(data, domain) {
  const byLayer = new Map();
  for (const series of data.float8) {
    if (!['saturated_fraction', 'underflow_fraction'].includes(series.statistic)) continue;
    if (!byLayer.has(series.layer)) byLayer.set(series.layer, []);
    byLayer.get(series.layer).push(series);
  }
  const charts = [];
  for (const [layer, series] of byLayer) {
    const lines = series.map((s) => ({
      points: s.points,
      cls: `float8 ${s.statistic} tensor-${s.tensor}`,
      label: `${s.tensor} ${s.statistic === 'saturated_fraction' ? 'saturated' : 'zero once quantized'}`,
    }));
    const values = series.flatMap((s) => s.points.map(([, v]) => v));
    const high = Math.max(1e-6, ...values);
    const chart = lineChart(domain, lines, {yDomain: [0, high * 1.05], yFormat: (v) => `${(v * 100).toPrecision(2)}%`});
    charts.push(figure(`float8 ${layer}: saturated and zero-once-quantized fraction`, chart, 'float8', lines));
  }
  return charts;
}

// ---------------------------------------------------------------- drawing
function lineChart(xDomain, lines, {yDomain, yTicks, yFormat}) {
  const height = 220;
  const svg = el('svg', {class: 'chart', width: WIDTH, height, viewBox: `0 0 ${WIDTH} ${height}`});
  const values = lines.flatMap((l) => l.points.map(([, v]) => v)).filter(Number.isFinite);
  if (!yDomain) {
    const low = values.length ? Math.min(...values) : 0;
    const high = values.length ? Math.max(...values) : 1;
    const pad = (high - low || Math.abs(high) || 1) * 0.05;
    yDomain = [low - pad, high + pad];
  }
  const bottom = height - MARGIN.bottom;
  const x = (v) => MARGIN.left + ((v - xDomain[0]) / (xDomain[1] - xDomain[0] || 1)) * (WIDTH - MARGIN.left - MARGIN.right);
  const y = (v) => bottom - ((v - yDomain[0]) / (yDomain[1] - yDomain[0] || 1)) * (bottom - MARGIN.top);
  for (const tick of yTicks || niceTicks(yDomain)) {
    svg.appendChild(el('line', {class: 'grid', x1: MARGIN.left, x2: WIDTH - MARGIN.right, y1: y(tick), y2: y(tick)}));
    svg.appendChild(
      el('text', {class: 'tick', x: MARGIN.left - 6, y: y(tick) + 4, 'text-anchor': 'end'}, (yFormat || formatNumber)(tick)),
    );
  }
  drawXAxis(svg, x, xDomain, bottom, 'step');
  for (const line of lines) {
    const points = line.points.filter(([, v]) => Number.isFinite(v));
    if (!points.length) continue;
    const coords = [];
    points.forEach(([s, v], i) => {
      if (line.stepped && i > 0) coords.push(`${x(s)},${y(points[i - 1][1])}`);
      coords.push(`${x(s)},${y(v)}`);
    });
    svg.appendChild(
      el('polyline', {class: `series ${line.cls}`, points: coords.join(' ')}, el('title', {}, line.label || '')),
    );
    if (points.length === 1) svg.appendChild(el('circle', {class: `series-dot ${line.cls}`, cx: x(points[0][0]), cy: y(points[0][1]), r: 3}));
  }
  svg.scales = {x, y};
  svg.plotBottom = bottom;
  return svg;
}

function drawXAxis(svg, x, domain, bottom, axis) {
  svg.appendChild(el('line', {class: 'axis', x1: x(domain[0]), x2: x(domain[1]), y1: bottom, y2: bottom}));
  for (const tick of niceTicks(domain).filter((t) => Number.isInteger(t))) {
    svg.appendChild(el('text', {class: 'tick', x: x(tick), y: bottom + 14, 'text-anchor': 'middle'}, String(tick)));
  }
  svg.appendChild(el('text', {class: 'axis-name', x: x(domain[1]), y: bottom + 28, 'text-anchor': 'end'}, AXIS_NAMES[axis] || axis));
}

function figure(title, chart, kind, legend) {
  const fig = el('figure', {class: `chart-${kind}`}, el('figcaption', {}, title), chart);
  if (legend) {
    fig.appendChild(el('p', {class: 'legend'}, ...legend.map((l) => el('span', {class: `key ${l.cls}`}, l.label))));
  }
  return fig;
}

function note(svg, text) {
  return el('text', {class: 'note', x: WIDTH - MARGIN.right - 4, y: MARGIN.top + 14, 'text-anchor': 'end'}, text);
}

function integerTicks([low, high]) {
  const first = Math.ceil(low);
  const last = Math.floor(high);
  const every = Math.max(1, Math.ceil((last - first + 1) / 8));
  const ticks = [];
  for (let t = first; t <= last; t += every) ticks.push(t);
  return ticks;
}

function niceTicks([low, high]) {
  const span = high - low || 1;
  const raw = span / 6;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
  const ticks = [];
  for (let t = Math.ceil(low / step) * step; t <= high + 1e-9; t += step) ticks.push(Number(t.toPrecision(12)));
  return ticks;
}

function formatScale(value) {
  const power = Math.log2(value);
  return Number.isInteger(power) ? `2^${power} (${formatNumber(value)})` : formatNumber(value);
}

function formatNumber(value) {
  if (typeof value !== 'number') return String(value);
  if (Number.isInteger(value) && Math.abs(value) < 1e9) return String(value);
  if (value !== 0 && (Math.abs(value) >= 1e5 || Math.abs(value) < 1e-3)) return value.toExponential(2);
  return String(Number(value.toPrecision(4)));
}

function shorten(text, size) {
  return text.length <= size ? text : `…${text.slice(text.length - size + 1)}`;
}

async function getJson(path) {
  const response = await fetch(path);
  if (!response.ok) throw new Error(`${response.status} ${await response.text()}`);
  return response.json();
}

function el(tag, attributes, ...children) {
  const svgTags = ['svg', 'line', 'polyline', 'circle', 'rect', 'text', 'title', 'g'];
  const node = svgTags.includes(tag) ? document.createElementNS(SVG, tag) : document.createElement(tag);
  for (const [key, value] of Object.entries(attributes || {})) node.setAttribute(key, String(value));
  for (const child of children) node.append(child);
  return node;
}
