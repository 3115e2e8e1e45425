// Explore's linked views: chip and plot clicks, dragged boxes -> #explore-action; app/tabs/explore/tab.py BRIDGE_JS.
() => {
  if (window.lmscopeBridge) return [];
  window.lmscopeBridge = true;
  const style = document.createElement('style');
  style.textContent = '#tokens [data-pos] { cursor: pointer; } #tokens .tok-query { outline: 2px solid #e4572e; outline-offset: 1px; }';
  document.head.appendChild(style);
  let seq = 0;
  const send = (msg) => {
    const box = document.querySelector('#explore-action textarea, #explore-action input');
    if (!box) return;
    msg.n = ++seq;  // every message differs from the last
    box.value = JSON.stringify(msg);
    box.dispatchEvent(new Event('input', {bubbles: true}));  // the component's value ...
    box.dispatchEvent(new KeyboardEvent('keypress', {key: 'x', bubbles: true}));  // ... and Gradio 6's input event
  };
  const num = (v) => { if (typeof v === 'string') { const m = v.match(/\d+/); return m ? +m[0] : null; }
                       return typeof v === 'number' ? Math.round(v) : null; };
  const meta = (gd) => (gd.layout && gd.layout.meta && gd.layout.meta.lmscope) || {};
  const span = (ax, a, b) => {  // a dragged range on an axis -> [first, last] position
    if (!ax || a === undefined || b === undefined) return null;
    let lo = Math.round(Math.min(a, b)), hi = Math.round(Math.max(a, b));
    if (ax.cat) { lo += ax.lo; hi += ax.lo; }
    lo = Math.max(ax.lo, lo); hi = Math.min(ax.hi, hi);
    return hi >= lo ? [lo, hi] : null;
  };
  document.addEventListener('click', (e) => {
    const chip = e.target.closest && e.target.closest('#tokens [data-pos]');
    if (chip) send({kind: 'query', pos: +chip.dataset.pos});
  });
  const onClick = (gd, ev) => {
    const p = ev && ev.points && ev.points[0];
    if (!p) return;
    const m = meta(gd);
    if (m.kind === 'overview') send({kind: 'head', layer: num(p.y), head: num(p.x)});
    else if (m.kind === 'grid') send({kind: 'head', head: p.curveNumber});
    else if (m.kind === 'head') send({kind: 'query', pos: num(p.y)});
    else if (m.kind === 'lens') send({kind: 'lens', layer: num(p.y), pos: num(p.x)});
  };
  const onZoom = (gd, ev) => {
    const m = meta(gd);
    if (!ev || (m.kind !== 'head' && m.kind !== 'lens')) return;
    if (ev['xaxis.autorange'] === true || ev['yaxis.autorange'] === true) { send({kind: 'zoom'}); return; }
    const cols = span(m.x, ev['xaxis.range[0]'], ev['xaxis.range[1]']);
    const rows = m.kind === 'head' ? span(m.y, ev['yaxis.range[0]'], ev['yaxis.range[1]']) : cols;
    if (!cols && !rows) return;  // not a zoom (a resize, a pan of nothing)
    const whole = (ax) => ax ? [ax.lo, ax.hi] : null;
    send({kind: 'zoom', rows: rows || whole(m.y), cols: cols || whole(m.x)});
  };
  const bind = () => {
    for (const id of ['head-overview', 'head-grid', 'head-big', 'lens']) {
      const gd = document.querySelector('#' + id + ' .js-plotly-plot');
      if (!gd || !gd.on || gd.lmscopeBound) continue;
      gd.lmscopeBound = true;
      gd.on('plotly_click', (ev) => onClick(gd, ev));
      gd.on('plotly_relayout', (ev) => onZoom(gd, ev));
    }
    const q = document.querySelector('#query input[type=number]');
    const want = q ? q.value : null;
    for (const c of document.querySelectorAll('#tokens .tok-query')) if (c.dataset.pos !== want) c.classList.remove('tok-query');
    const chip = want !== null && document.querySelector('#tokens [data-pos="' + want + '"]');
    if (chip && !chip.classList.contains('tok-query')) chip.classList.add('tok-query');
  };
  // Plotly points gradients (colour bars) and clip paths at url(<page URL>#id) when the page has a
  // <base> (Gradio's has), with the URL of the moment the plot was made; once the URL changes (the
  // view state is mirrored into it) those references break and colour bars go blank. Re-point them.
  const fixUrls = () => {
    const base = location.href.split('#')[0];
    for (const gd of document.querySelectorAll('.js-plotly-plot')) {
      const old = gd._context && gd._context._baseUrl;
      if (!old || old === base) continue;
      gd._context._baseUrl = base;
      for (const el of gd.querySelectorAll('[style*="url("], [clip-path*="url("], [fill*="url("], [stroke*="url("]')) {
        for (const a of ['clip-path', 'fill', 'stroke']) {
          const v = el.getAttribute(a);
          if (v && v.includes(old)) el.setAttribute(a, v.split(old).join(base));
          const w = el.style.getPropertyValue(a);
          if (w && w.includes(old)) el.style.setProperty(a, w.split(old).join(base));
        }
      }
    }
  };
  setInterval(() => { bind(); fixUrls(); }, 300);
  return [];
}
