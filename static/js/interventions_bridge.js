// Interventions' cross-links: a click on a head's cell in the patching (heads) or attribution heatmap
// sends "L<layer>H<head>" (from the figure's layout.meta.lmscope) to #iv-head-pick, whose input event
// puts that head in "Heads to switch off"; installed once by app/tabs/interventions/tab.py.
() => {
  if (window.lmscopeIvBridge) return [];
  window.lmscopeIvBridge = true;
  let seq = 0;
  const send = (head) => {
    const box = document.querySelector('#iv-head-pick textarea, #iv-head-pick input');
    if (!box) return;
    box.value = JSON.stringify({head: head, n: ++seq});  // every message differs from the last
    box.dispatchEvent(new Event('input', {bubbles: true}));
    box.dispatchEvent(new KeyboardEvent('keypress', {key: 'x', bubbles: true}));  // Gradio 6's input event
  };
  const onClick = (gd, ev) => {
    const p = ev && ev.points && ev.points[0];
    const m = (gd.layout && gd.layout.meta && gd.layout.meta.lmscope) || {};
    if (!p || m.kind !== 'heads' || !m.layers || !m.heads) return;
    const layer = m.layers[Math.round(p.y)], head = m.heads[Math.round(p.x)];
    if (layer === undefined || head === undefined) return;
    send('L' + layer + 'H' + head);
  };
  const bind = () => {
    for (const id of ['iv-patch-plot', 'iv-attr-heads']) {
      const gd = document.querySelector('#' + id + ' .js-plotly-plot');
      if (!gd || !gd.on || gd.lmscopeIvBound) continue;
      gd.lmscopeIvBound = true;
      gd.on('plotly_click', (ev) => onClick(gd, ev));
    }
  };
  setInterval(bind, 300);
  return [];
}
