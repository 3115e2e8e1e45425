// A click on a bar of Generate's step timeline opens that step: the step number goes to the hidden
// #gen-step-click box; app/tabs/generate/tab.py TIMELINE_CLICK_JS (loaded once with the page).
() => {
  if (window.lmscopeTimelineClick) return [];
  window.lmscopeTimelineClick = true;
  let seq = 0;
  const send = (step) => {
    const box = document.querySelector('#gen-step-click textarea, #gen-step-click input');
    if (!box) return;
    box.value = step + ':' + (++seq);  // every click differs from the last
    box.dispatchEvent(new Event('input', {bubbles: true}));
    box.dispatchEvent(new KeyboardEvent('keypress', {key: 'x', bubbles: true}));
  };
  setInterval(() => {
    const gd = document.querySelector('#gen-timeline .js-plotly-plot');
    if (!gd || !gd.on || gd.lmscopeStepBound) return;
    gd.lmscopeStepBound = true;
    gd.on('plotly_click', (ev) => {
      const p = ev && ev.points && ev.points[0];
      if (p && typeof p.x === 'number') send(Math.round(p.x));
    });
    gd.style.cursor = 'pointer';
  }, 300);
  return [];
}
